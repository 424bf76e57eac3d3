"""Reasoning content through the real gateway: a thinking model's ``<think>…</think>`` comes back
apart from the answer, in ``reasoning_content`` on chat completions and as a ``reasoning`` item on
``/v1/responses``, with stop strings and usage as before.

The worker is a text worker (plain nats-py, as ``test_text_worker``): the gateway has no chat
template for its model, so ``auto`` would leave its output alone and these tests run the gateway
with ``reasoning_parser="think"``; the output opens the reasoning itself (as Qwen3's does). It
answers with the last message's text, cut into pieces of three characters (so the tags arrive
split across chunks), one piece a token, up to ``max_tokens``. Real nats-server and admission,
the gateway's HTTP app; the Responses API is read with the ``openai`` client, which checks the
shapes against its types."""

from __future__ import annotations

import json
import math

import openai
import pytest
from aiohttp.test_utils import TestClient

from test_gateway_misbehaving_workers import sse_events
from test_text_worker import TextWorker, serving

MODEL = "thinking-llm"
TTL_S = 5.0
PIECE = 3  # characters a chunk
THOUGHT = "The user wants the capital of France. It is Paris."
ANSWER = "The capital of France is Paris."
OUTPUT = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"


def num_pieces(text: str) -> int:
    return math.ceil(len(text) / PIECE)


class ScriptedWorker(TextWorker):
    """A text worker whose output is the last message's (or the prompt's) text."""

    WORKER_ID, MODEL = "think-1", MODEL

    async def serve(self, msg) -> None:
        req = json.loads(msg.data)
        source = req["messages"][-1]["content"] if req.get("messages") else req["prompt_text"]
        pieces = [source[i:i + PIECE] for i in range(0, len(source), PIECE)]
        max_tokens = req["sampling"]["max_tokens"]
        sent = pieces[:max_tokens]
        for i, piece in enumerate(sent):
            finish = ("length" if len(pieces) > max_tokens else "stop") if i == len(sent) - 1 else None
            await self.nc.publish(msg.reply, json.dumps({
                "request_id": req["request_id"], "index": i, "text": piece, "finish_reason": finish,
                "num_prompt_tokens": 7 if i == 0 else 0}).encode())
        await self.nc.publish(msg.reply, b"", headers={"Tandem-Stream": "end"})


@pytest.fixture
def parser() -> str:
    return "think"


@pytest.fixture
async def setup(bus, nats_url, namespace, parser):
    async with serving(bus, nats_url, namespace, ScriptedWorker, reasoning_parser=parser) as (client, _):
        yield client


def chat(text: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 100, **extra}


async def test_a_chat_answer_has_the_reasoning_apart_and_the_same_usage(setup):
    resp = await setup.post("/v1/chat/completions", json=chat(OUTPUT))
    body = await resp.json()
    assert resp.status == 200, body
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == f"\n{THOUGHT}\n"
    assert message["content"] == ANSWER
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == num_pieces(OUTPUT)  # every token counts, reasoning included


async def test_a_streamed_chat_sends_the_reasoning_first_then_the_answer(setup):
    resp = await setup.post("/v1/chat/completions", json=chat(OUTPUT, stream=True,
                                                              stream_options={"include_usage": True}))
    assert resp.status == 200
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, key=lambda k: k == "content") and len(set(kinds)) == 2, kinds
    assert "".join(d.get("reasoning_content", "") for d in deltas) == f"\n{THOUGHT}\n"
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER
    assert not any("<" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "stop"
    assert events[-2]["usage"]["completion_tokens"] == num_pieces(OUTPUT)


async def test_a_stop_string_applies_to_the_answer_only(setup):
    text = "<think>I will say Paris. END</think> Paris. END and more"
    resp = await setup.post("/v1/chat/completions", json=chat(text, stop=["END"]))
    body = await resp.json()
    assert resp.status == 200, body
    assert body["choices"][0]["message"]["reasoning_content"] == "I will say Paris. END"
    assert body["choices"][0]["message"]["content"] == "Paris. "
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_output_cut_off_while_reasoning_is_all_reasoning(setup, stream):
    cut = 6  # pieces: "<th", "ink", ">\nT", "he ", "use", "r w"
    resp = await setup.post("/v1/chat/completions", json=chat(OUTPUT, max_tokens=cut, stream=stream))
    assert resp.status == 200
    if stream:
        events = [e for e in (await sse_events(resp))[:-1] if e["choices"]]
        deltas = [e["choices"][0]["delta"] for e in events]
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        finish = events[-1]["choices"][0]["finish_reason"]
    else:
        choice = (await resp.json())["choices"][0]
        reasoning, content, finish = choice["message"]["reasoning_content"], choice["message"]["content"], \
            choice["finish_reason"]
        assert content is None
    assert reasoning == OUTPUT[:cut * PIECE].removeprefix("<think>")
    assert not content and finish == "length"


async def test_completions_are_not_parsed(setup):
    resp = await setup.post("/v1/completions", json={"model": MODEL, "prompt": OUTPUT, "max_tokens": 100})
    body = await resp.json()
    assert resp.status == 200, body
    assert body["choices"][0]["text"] == OUTPUT


@pytest.mark.parametrize("parser", ["auto", "none"])
async def test_without_the_parser_the_tags_stay_in_the_content(setup):
    """``auto`` needs the model's chat template to mention ``</think>``; the gateway has none for a
    text worker's model."""
    resp = await setup.post("/v1/chat/completions", json=chat(OUTPUT))
    message = (await resp.json())["choices"][0]["message"]
    assert message["content"] == OUTPUT and "reasoning_content" not in message


def sdk(client: TestClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0, timeout=30)


async def test_a_response_has_a_reasoning_item_before_the_message(setup):
    response = await sdk(setup).responses.create(model=MODEL, input=OUTPUT, store=False)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", f"\n{THOUGHT}\n")]
    assert reasoning.summary == [] and reasoning.id.startswith("rs_")
    assert response.output_text == ANSWER and response.status == "completed"
    assert response.usage.output_tokens == num_pieces(OUTPUT)


async def test_a_streamed_response_streams_the_reasoning_then_the_message(setup):
    stream = await sdk(setup).responses.create(model=MODEL, input=OUTPUT, store=False, stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    reasoning_at = [i for i, k in enumerate(kinds) if k == "response.reasoning_text.delta"]
    text_at = [i for i, k in enumerate(kinds) if k == "response.output_text.delta"]
    assert reasoning_at and text_at and max(reasoning_at) < kinds.index("response.reasoning_text.done") < min(text_at)
    assert "".join(events[i].delta for i in reasoning_at) == f"\n{THOUGHT}\n"
    assert "".join(events[i].delta for i in text_at) == ANSWER
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "reasoning"), (1, "message")]
    assert all(events[i].output_index == 1 for i in text_at)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1]
    assert done.type == "response.completed"
    assert [item.type for item in done.response.output] == ["reasoning", "message"]
    assert done.response.output[0].content[0].text == f"\n{THOUGHT}\n" and done.response.output_text == ANSWER


async def test_a_response_cut_off_while_reasoning_has_no_message(setup):
    response = await sdk(setup).responses.create(model=MODEL, input=OUTPUT, store=False, max_output_tokens=6)
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.status == "incomplete" and response.output[0].status == "incomplete"
    assert response.output_text == ""
