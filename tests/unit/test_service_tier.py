"""OpenAI's ``service_tier`` on the QoS tiers: which tier each value asks for, the API key's cap,
the value echoed, the flex wait, and the field in every body and chunk (no sockets)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from shared.openai_api import retry
from shared.openai_api.adapters import ChatAdapter, Choice, CompletionAdapter, Delta, ResponseHead
from shared.openai_api.errors import ApiError
from shared.openai_api.responses import usage
from shared.openai_api.responses_api import ResponsesAdapter
from shared.planner.config import ConfigError
from shared.policy.qos import QosConfig, QosTier, ServedTier, load_qos, serve_tier
from shared.tokenizer import Tokenizer
from word_tokens import word_tokenizer

QOS = QosConfig(default_tier="standard", tiers={
    "premium": QosTier(priority=0), "standard": QosTier(priority=1), "batch": QosTier(priority=2)})


@pytest.mark.parametrize("asked,key_tier,expected", [
    # no mapping given: auto and default → the key's tier, flex → the lowest, priority → the highest
    ("auto", "premium", ServedTier("premium", "priority")),    # auto: named for the tier it ran in
    ("auto", "standard", ServedTier("standard", "default")),
    ("default", "premium", ServedTier("premium", "default")),  # served as asked: echoed as asked
    ("default", "batch", ServedTier("batch", "default")),
    ("flex", "premium", ServedTier("batch", "flex", waits=True)),
    ("flex", "batch", ServedTier("batch", "flex", waits=True)),
    ("priority", "premium", ServedTier("premium", "priority")),
    # above the key's tier: served at the key's own, and named for it (no error, as OpenAI)
    ("priority", "standard", ServedTier("standard", "default")),
    ("priority", "batch", ServedTier("batch", "flex")),
    # not asked: the key's tier, as before service_tier, and nothing echoed
    (None, "premium", ServedTier("premium", None)),
    (None, "batch", ServedTier("batch", None)),
])
def test_each_value_asks_for_a_tier_and_the_keys_tier_caps_it(asked, key_tier, expected):
    assert serve_tier(QOS, asked, key_tier) == expected


def test_a_mapping_in_the_file_is_used_and_still_capped():
    qos = QOS.model_copy(update={"service_tiers": QOS.service_tiers.model_copy(
        update={"auto": "standard", "default": "standard", "flex": "standard", "priority": "standard"})})
    assert serve_tier(qos, "priority", "premium") == ServedTier("standard", "priority")  # mapped lower: allowed
    assert serve_tier(qos, "flex", "premium") == ServedTier("standard", "flex", waits=True)
    assert serve_tier(qos, "auto", "premium") == ServedTier("standard", "default")
    assert serve_tier(qos, None, "premium") == ServedTier("standard", None)  # no service_tier is auto
    # the mapping names standard, above a batch key: the key's own tier, named for it
    assert serve_tier(qos, "default", "batch") == ServedTier("batch", "flex")
    assert serve_tier(qos, "priority", "batch") == ServedTier("batch", "flex")


def test_one_tier_serves_every_value_at_it():
    one = QosConfig.single()
    for asked in ("auto", "default", "priority"):
        assert serve_tier(one, asked, "default") == ServedTier("default", "default" if asked == "auto" else asked)
    assert serve_tier(one, "flex", "default") == ServedTier("default", "flex", waits=True)


def test_the_mapping_is_read_from_the_qos_file_and_checked(tmp_path):
    path = tmp_path / "qos.yaml"
    path.write_text("default_tier: standard\ntiers:\n  premium: {priority: 0}\n  standard: {priority: 1}\n"
                    "  batch: {priority: 2}\nservice_tiers: {flex: standard, priority: premium}\n")
    qos = load_qos(path)
    assert (qos.service_tiers.flex, qos.service_tiers.priority, qos.service_tiers.auto) == ("standard", "premium", None)
    assert serve_tier(qos, "flex", "premium").tier == "standard"
    path.write_text("default_tier: standard\ntiers:\n  standard: {priority: 1}\nservice_tiers: {flex: gold}\n")
    with pytest.raises(ConfigError, match="gold"):
        load_qos(path)
    path.write_text("default_tier: standard\ntiers:\n  standard: {priority: 1}\nservice_tiers: {scale: standard}\n")
    with pytest.raises(ConfigError, match="scale"):
        load_qos(path)


def test_the_example_qos_file_loads():
    qos = load_qos(Path(__file__).parents[2] / "examples" / "qos.yaml")
    assert serve_tier(qos, "flex", qos.default_tier).tier == "batch"


# --- the echo in bodies and chunks -----------------------------------------------------------------
WORDS = ["<unk>", "user", "assistant", ":", "hello", "world"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return word_tokenizer(WORDS, "{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}assistant :")


def body(**fields) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def test_every_endpoint_takes_the_four_values_and_refuses_others(tok):
    for value in ("auto", "default", "flex", "priority"):
        assert ChatAdapter.from_json(body(messages=[{"role": "user", "content": "hello"}], service_tier=value),
                                     tok).body.service_tier == value
        assert CompletionAdapter.from_json(body(prompt="hello", service_tier=value), tok).body.service_tier == value
        assert ResponsesAdapter.from_json(body(input="hello", service_tier=value), tok).body.service_tier == value
    with pytest.raises(ApiError) as info:
        CompletionAdapter.from_json(body(prompt="hello", service_tier="scale"), tok)
    assert (info.value.status, info.value.param) == (400, "service_tier")


def test_the_served_tier_is_in_every_body_and_chunk_the_sdk_reads(tok):
    head = ResponseHead("chatcmpl-1", 7, "m", "flex")
    chat = ChatAdapter.from_json(body(messages=[{"role": "user", "content": "hello"}], service_tier="flex",
                                      stream_options={"include_usage": True}, stream=True), tok)
    chunks = chat.opening_chunks(head, 0) + chat.stream_chunks(head, 0, Delta("hi", [], "stop"), 0)
    chunks += chat.closing_chunks(head, usage(1, 1, 0))
    assert [ChatCompletionChunk.model_validate(c).service_tier for c in chunks] == ["flex"] * 3
    whole = chat.response(head, [chat.choice(0, Choice("hi", "stop", []))], usage(1, 1, 0))
    assert ChatCompletion.model_validate(whole).service_tier == "flex"

    completion = CompletionAdapter.from_json(body(prompt="hello", service_tier="flex"), tok)
    assert completion.chunk(head, 0, Delta("hi"), 0)["service_tier"] == "flex"
    whole = completion.response(head, [completion.choice(0, Choice("hi", "stop", []))], usage(1, 1, 0))
    assert Completion.model_validate(whole).service_tier == "flex"  # the SDK keeps the extra field

    responses = ResponsesAdapter.from_json(body(input="hello", service_tier="flex"), tok)
    events = responses.opening_chunks(head, 0) + responses.closing_chunks(head, usage(1, 1, 0))
    assert [Response.model_validate(e["response"]).service_tier for e in events if "response" in e] == ["flex"] * 3


def test_nothing_is_echoed_when_nothing_was_asked(tok):
    head = ResponseHead("chatcmpl-1", 7, "m")
    chat = ChatAdapter.from_json(body(messages=[{"role": "user", "content": "hello"}]), tok)
    assert "service_tier" not in chat.chunk(head, 0, Delta("hi"), 0)
    assert "service_tier" not in chat.response(head, [chat.choice(0, Choice("hi", "stop", []))], usage(1, 1, 0))
    responses = ResponsesAdapter.from_json(body(input="hello"), tok)
    assert "service_tier" not in responses.shell(head, "queued")


# --- flex: 429s for load are waited out --------------------------------------------------------------
def run_with_waits(errors: list[ApiError | None], max_wait_s: float, monkeypatch) -> tuple[object, list[float]]:
    """``waiting_out_429s`` over an attempt that raises ``errors`` in turn (None: succeeds), with
    a clock that moves only by the waits."""
    now, waits = [0.0], []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(retry.asyncio, "sleep", sleep)
    monkeypatch.setattr(retry.time, "monotonic", lambda: now[0])
    tries = iter(errors)

    async def attempt() -> str:
        if (exc := next(tries)) is not None:
            raise exc
        return "served"

    try:
        return asyncio.run(retry.waiting_out_429s(attempt, max_wait_s, "r-1")), waits
    except ApiError as exc:
        return exc, waits


def shed() -> ApiError:
    return ApiError(429, "tier shed", code="shedding", retry_after_s=3.0)


def test_a_flex_request_waits_out_429s_for_load_and_then_runs(monkeypatch):
    result, waits = run_with_waits([shed(), shed(), None], 60.0, monkeypatch)
    assert (result, waits) == ("served", [3.0, 3.0])


def test_a_flex_request_gives_up_after_its_wait_with_the_last_429(monkeypatch):
    result, waits = run_with_waits([shed()] * 4, 7.0, monkeypatch)
    assert waits == [3.0, 3.0, 1.0]  # never past the bound: the last try comes when it is up
    assert isinstance(result, ApiError) and result.code == "shedding" and "the last of 4 tries in 7s" in result.message


@pytest.mark.parametrize("exc", [ApiError(429, "too long", code="prompt_too_long", retry_after_s=1.0),
                                 ApiError(503, "down", code="admission_unavailable", retry_after_s=1.0)])
def test_an_error_that_waiting_does_not_change_is_answered_at_once(exc, monkeypatch):
    result, waits = run_with_waits([exc], 60.0, monkeypatch)
    assert result is exc and waits == [] and "tries" not in exc.message


def test_without_a_wait_a_429_is_answered_at_once(monkeypatch):
    result, waits = run_with_waits([shed()], 0.0, monkeypatch)
    assert isinstance(result, ApiError) and waits == []
