"""A text worker (``WorkerInfo.takes_text``): text in, text out, with its own tokenizer. The gateway
serves its model although it has no tokenizer for it (its own is a toy word-level one for another
model): chat messages or the prompt text go to the worker as they are, its text comes back as the
answer, stop strings still apply, and what needs the model's tokens is a 400 naming the parameter.
Real nats-server, real admission, the gateway's HTTP app; the worker is plain nats-py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.admission.config import AdmissionSettings
from services.admission.service import AdmissionService
from services.gateway.config import GatewaySettings
from services.gateway.service import Gateway, build_app
from shared.bus import WorkerRegistry
from shared.protocol import Subjects, WorkerInfo
from services.stack.waiting import wait_until
from test_gateway_misbehaving_workers import sse_events, tokenizer

TEXT_MODEL = "remote-llm"
TTL_S = 5.0


class TextWorker:
    """Answers with the words of the last message (or the prompt) in upper case, a word a chunk.
    A subclass answers otherwise by its own ``serve``, under its own ``WORKER_ID`` and ``MODEL``."""

    WORKER_ID, MODEL = "text-1", TEXT_MODEL

    def __init__(self, nc, subjects: Subjects) -> None:
        self.nc, self.subjects = nc, subjects
        self.requests: list[dict] = []
        self.tasks: set[asyncio.Task] = set()

    async def start(self, registry: WorkerRegistry) -> None:
        generate = self.subjects.decode_generate(self.WORKER_ID).subject

        async def on_generate(msg) -> None:
            task = asyncio.create_task(self.serve(msg))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

        await self.nc.subscribe(generate, cb=on_generate)
        await registry.put(WorkerInfo(worker_id=self.WORKER_ID, role="decode", model=self.MODEL, block_size=16,
                                      max_model_len=4096, max_num_seqs=8, generate_subject=generate,
                                      takes_text=True, started_at=time.time()))

    async def serve(self, msg) -> None:
        req = json.loads(msg.data)
        self.requests.append(req)
        source = req["messages"][-1]["content"] if req.get("messages") else req["prompt_text"]
        words = [w.upper() for w in source.split()][:req["sampling"]["max_tokens"]]
        for i, word in enumerate(words):
            last = i == len(words) - 1
            await self.nc.publish(msg.reply, json.dumps({
                "request_id": req["request_id"], "index": i, "text": (" " if i else "") + word,
                "finish_reason": ("length" if len(words) == req["sampling"]["max_tokens"] else "stop") if last else None,
                "num_prompt_tokens": len(source.split()) if i == 0 else 0}).encode())
        await self.nc.publish(msg.reply, b"", headers={"Tandem-Stream": "end"})


@contextlib.asynccontextmanager
async def serving(bus, nats_url: str, namespace: str, worker_class: type[TextWorker] = TextWorker, **gateway_settings):
    """A ``worker_class`` worker registered, a real admission and the gateway's HTTP app in front of
    it (its own tokenizer a toy one for another model); yields (client, worker)."""
    subjects = Subjects(namespace)
    common = dict(nats_url=nats_url, namespace=namespace, registry_ttl_s=TTL_S, refresh_interval_s=0.1)
    registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=TTL_S, watch=True)
    worker = worker_class(bus.nc, subjects)
    await worker.start(registry)
    admission = AdmissionService(AdmissionSettings(**common), bus, registry)
    await admission.start()
    gateway = Gateway(GatewaySettings(model="toy", **gateway_settings, **common), bus, registry, tokenizer())
    tasks = [asyncio.create_task(s.run_forever()) for s in (admission, gateway)]
    client = TestClient(TestServer(build_app(gateway)))
    try:
        async def listed() -> bool:
            await gateway.refresh()
            return bool(gateway.ready_workers(worker.MODEL))

        await wait_until(listed, timeout_s=10, what="the text worker in the registry")
        await client.start_server()
        yield client, worker
    finally:
        await client.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
async def setup(bus, nats_url, namespace):
    async with serving(bus, nats_url, namespace) as served:
        yield served


async def test_the_text_model_is_listed_and_answers_chat_from_the_messages_as_text(setup):
    client, worker = setup
    models = [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]]
    assert TEXT_MODEL in models and "toy" in models
    resp = await client.post("/v1/chat/completions", json={
        "model": TEXT_MODEL, "max_tokens": 10,
        "messages": [{"role": "system", "content": "be loud"}, {"role": "user", "content": "hello über world"}]})
    body = await resp.json()
    assert resp.status == 200, body
    assert body["choices"][0]["message"]["content"] == "HELLO ÜBER WORLD"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 3
    sent = worker.requests[0]
    assert sent["messages"] == [{"role": "system", "content": "be loud"}, {"role": "user", "content": "hello über world"}]
    assert sent["prompt_token_ids"] == [] and sent["block_hashes"] == [] and sent["prompt_text"] is None


async def test_a_streamed_completion_from_the_prompt_text_with_a_stop_string(setup):
    client, worker = setup
    resp = await client.post("/v1/completions", json={
        "model": TEXT_MODEL, "prompt": "one two three four five", "max_tokens": 4, "stream": True,
        "stop": [" THREE"]})
    assert resp.status == 200
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == "ONE TWO"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "stop"
    assert worker.requests[0]["prompt_text"] == "one two three four five"


@pytest.mark.parametrize("extra,param", [({"logprobs": True}, "logprobs"), ({"logit_bias": {"5": 1}}, "logit_bias"),
                                         ({"response_format": {"type": "json_object"}}, "response_format")])
async def test_what_needs_the_models_tokens_is_a_400_naming_it(setup, extra, param):
    client, worker = setup
    resp = await client.post("/v1/chat/completions", json={
        "model": TEXT_MODEL, "messages": [{"role": "user", "content": "hi"}], **extra})
    body = await resp.json()
    assert resp.status == 400 and body["error"]["param"] == param, body
    assert worker.requests == []


async def test_a_responses_stream_names_each_event_and_a_chat_stream_does_not(setup):
    """As OpenAI streams them: ``event: <type>`` before each data line of ``/v1/responses``, none
    on chat completions."""
    client, _ = setup
    resp = await client.post("/v1/responses", json={
        "model": TEXT_MODEL, "input": "one two", "stream": True, "store": False})
    assert resp.status == 200
    blocks = [b.splitlines() for b in (await resp.text()).split("\n\n") if b.strip()]
    named = [b for b in blocks if b[-1] != "data: [DONE]"]
    assert named and all(len(b) == 2 and b[0] == f"event: {json.loads(b[1].removeprefix('data: '))['type']}"
                         for b in named), blocks
    assert [b[0] for b in named][0] == "event: response.created" and named[-1][0] == "event: response.completed"
    resp = await client.post("/v1/chat/completions", json={
        "model": TEXT_MODEL, "messages": [{"role": "user", "content": "one two"}], "stream": True})
    assert resp.status == 200 and "event:" not in await resp.text()
