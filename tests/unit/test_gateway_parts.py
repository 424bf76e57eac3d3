"""The gateway's pure parts: API keys → tiers, the context rules of request building, the two
endpoint adapters, the ready-worker filter and the ``tandem status`` table. No sockets: a tiny
word-level tokenizer stands in for the model's."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.commands.status import format_status
from shared.protocol.status import StatusPage
from shared.cluster.view import ClusterView
from shared.cluster.workers import ready_workers
from shared.kvcache.hashing import hash_blocks
from shared.openai_api.adapters import ChatAdapter, Choice, CompletionAdapter, Delta, ResponseHead, parse_body
from services.gateway.stored_responses import retry_wait_s
from shared.openai_api.auth import ApiKeys, owns
from shared.planner.config import ConfigError
from shared.policy.qos import QosConfig, QosTier
from shared.openai_api.errors import ApiError
from shared.openai_api.generate_request import build_generate_request, max_tokens_in_context
from shared.openai_api.fields import CHAT_FIELDS
from shared.openai_api.json_body import MAX_JSON_DEPTH
from shared.openai_api.models import ChatCompletionRequest
from shared.protocol import TokenLogprob, WorkerInfo, WorkerLoad
from services.framework.lifecycle import every
from shared.tokenizer import Tokenizer
from word_tokens import word_tokenizer

WORDS = ["<unk>", "user", "assistant", ":", "hello", "world", "a", "b", "c", "d"]
TEMPLATE = "{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}assistant :"
HEAD = ResponseHead("r-1", 7, "m")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return word_tokenizer(WORDS, TEMPLATE)


def worker(worker_id: str, *, role="decode", state="ready", model="m", max_model_len=8) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, state=state, model=model, block_size=2,
                      max_model_len=max_model_len, generate_subject="g", kv_namespace_hex=b"ns".hex())


def chat(tok: Tokenizer, **fields) -> ChatAdapter:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello world"}], **fields}
    return ChatAdapter.from_json(json.dumps(body).encode(), tok)


def completion(tok: Tokenizer, **fields) -> CompletionAdapter:
    return CompletionAdapter.from_json(json.dumps({"model": "m", "prompt": "a b c", **fields}).encode(), tok)


def error_of(call) -> ApiError:
    with pytest.raises(ApiError) as info:
        call()
    return info.value


def test_api_keys_resolve_tiers_and_refuse_unknown_keys():
    qos = QosConfig(default_tier="silver", tiers={"gold": QosTier(priority=0), "silver": QosTier(priority=1)})
    keys = ApiKeys.parse(" k1:gold, k2 ,", qos)
    assert keys.key_tiers == {"k1": "gold", "k2": "silver"}
    assert keys.tier("Bearer k1") == "gold" and keys.tier("Bearer k2") == "silver"
    # a known key without its scheme (or under another) is refused too: only "Bearer <key>" counts
    for header in (None, "", "Bearer nope", "k3", "k1", "Basic k1", "Bearerk1", "Bearer ", "Token k1"):
        err = error_of(lambda: keys.tier(header))
        assert (err.status, err.code) == (401, "invalid_api_key")
    assert keys.tier("bearer  k1 ") == "gold"  # the scheme is case-insensitive (RFC 9110)
    assert ApiKeys.parse(None, qos).tier(None) == "silver"  # no keys configured: no auth, default tier
    assert ApiKeys.parse("k1", QosConfig.single()).tier("Bearer k1") == "default"
    with pytest.raises(ConfigError, match="names tier 'gold'"):
        ApiKeys.parse("k1:gold", QosConfig.single())


def test_owners_are_stable_hashes_of_keys_and_see_only_their_own():
    keys = ApiKeys.parse("k1,k2", QosConfig.single())
    a, b = keys.owner("Bearer k1"), keys.owner("Bearer k2")
    assert a != b and "k1" not in a and a == ApiKeys.parse("k2,k1", QosConfig.single()).owner("Bearer k1")
    assert a.startswith("key_") and len(a) == 20
    assert error_of(lambda: keys.owner("Bearer nope")).status == 401
    assert owns(a, a) and not owns(a, b) and not owns(a, None)  # None: stored without keys, or before owners
    assert ApiKeys.parse(None, QosConfig.single()).owner("Bearer anything") is None  # no keys: anonymous
    assert owns(None, a) and owns(None, None)  # ... who sees everything, as before owners


@pytest.mark.parametrize("status,code,retry_after_s,waited_s,expected", [
    (429, "overloaded", 3.0, 0.0, 3.0),         # admission's Retry-After
    (429, "slo", 0.01, 0.0, 0.5),               # at least half a second
    (429, "shedding", None, 0.0, 1.0),          # none given: a second
    (429, "tier_queue_full", 30.0, 590.0, 10.0),  # never past the total wait: the last try at its end
    (429, "overloaded", 3.0, 600.0, None),      # the wait is over: this rejection is the end
    (429, "prompt_too_long", 1.0, 0.0, None),   # waiting does not change these
    (429, "deadline", 1.0, 0.0, None),
    (503, "admission_unavailable", 1.0, 0.0, None),
    (400, "invalid_value", None, 0.0, None),
])
def test_a_background_response_waits_out_admissions_429s(status, code, retry_after_s, waited_s, expected):
    exc = ApiError(status, "no", code=code, retry_after_s=retry_after_s)
    assert retry_wait_s(exc, waited_s, max_wait_s=600.0) == expected
    assert retry_wait_s(exc, 0.0, max_wait_s=0.0) is None  # 0: no retry


@pytest.mark.parametrize("num_prompt,requested,max_len,expected", [
    (3, None, None, 100),   # no worker known: the default, unchecked
    (3, 5, None, 5),
    (3, None, 8, 5),        # the default cut to what the context leaves
    (3, 5, 8, 5),
    (1, None, 1000, 100),
])
def test_max_tokens_within_the_context(num_prompt, requested, max_len, expected):
    assert max_tokens_in_context(num_prompt, requested, max_len, 100, prompt_param="prompt") == expected


@pytest.mark.parametrize("num_prompt,requested,param", [(8, None, "messages"), (9, 1, "messages"),
                                                       (3, 6, "max_tokens")])
def test_requests_past_the_context_are_400_naming_the_parameter(num_prompt, requested, param):
    err = error_of(lambda: max_tokens_in_context(num_prompt, requested, 8, 100, prompt_param="messages"))
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", param)


def test_generate_request_from_a_chat_body(tok):
    api = chat(tok, temperature=0.5, logprobs=True, top_logprobs=2, max_completion_tokens=3)
    ids = api.prompt_ids()
    assert ids == tok.encode("user : hello world assistant :")
    req = build_generate_request(api, ids, tier="gold", priority=3, workers=[worker("w1", max_model_len=16)],
                                 served_models=["m"], default_max_tokens=100, now=12.5)
    assert req.request_id.startswith("chatcmpl-") and req.tier == "gold" and req.created_at == 12.5
    assert req.priority == 3
    assert (req.sampling.max_tokens, req.sampling.temperature, req.sampling.logprobs) == (3, 0.5, 2)
    assert req.block_hashes == hash_blocks(ids, 2, b"ns") and len(req.block_hashes) == 3


def test_unknown_model_is_404_and_a_long_prompt_names_its_parameter(tok):
    api = completion(tok)
    err = error_of(lambda: build_generate_request(api, [1, 2, 3], tier="default", workers=[],
                                                  served_models=["other"], default_max_tokens=4, now=0))
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    err = error_of(lambda: build_generate_request(api, [1] * 9, tier="default", workers=[worker("w1")],
                                                  served_models=["m"], default_max_tokens=4, now=0))
    assert err.param == "prompt"
    req = build_generate_request(api, [1, 2, 3], tier="default", workers=[], served_models=["m"],
                                 default_max_tokens=4, now=0)
    assert req.request_id.startswith("cmpl-") and req.block_hashes == []
    assert req.sampling.max_tokens == 16  # the completions endpoint's own default


def test_completion_prompts(tok):
    assert completion(tok, prompt=[4, 5]).prompt_ids() == [4, 5]
    assert completion(tok, prompt=["hello"]).prompt_ids() == [4]
    assert error_of(lambda: completion(tok, prompt=[4, 99]).prompt_ids()).param == "prompt"
    assert error_of(lambda: completion(tok, prompt="").prompt_ids()).param == "prompt"


def test_chat_chunks_and_response(tok):
    entry = TokenLogprob(token_id=4, logprob=-0.5)
    api = chat(tok, logprobs=True)
    assert api.opening_chunks(HEAD, 0)[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunk = api.chunk(HEAD, 0, Delta("hello", [entry]), offset=0)
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["delta"] == {"content": "hello"}
    assert chunk["choices"][0]["logprobs"]["content"][0]["token"] == "hello"
    assert api.chunk(HEAD, 2, Delta("", [], "stop"), offset=5)["choices"][0] == {
        "index": 2, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    full = api.response(HEAD, [api.choice(0, Choice("hello", "stop", [entry]))], {"total_tokens": 1})
    assert full["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert full["object"] == "chat.completion" and full["usage"] == {"total_tokens": 1}
    assert chat(tok).choice(0, Choice("x", "length", [entry]))["logprobs"] is None
    assert api.usage_chunk(HEAD, {"total_tokens": 1})["object"] == "chat.completion.chunk"


def test_completion_chunks_and_response(tok):
    entries = [TokenLogprob(token_id=4, logprob=-0.5), TokenLogprob(token_id=5, logprob=-1.0)]
    api = completion(tok, logprobs=0)
    assert api.opening_chunks(HEAD, 0) == []
    chunk = api.chunk(HEAD, 0, Delta("helloworld", entries), offset=3)
    assert chunk["object"] == "text_completion" and chunk["choices"][0]["text"] == "helloworld"
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [3, 8]
    full = api.response(HEAD, [api.choice(1, Choice("helloworld", "length", entries))], {})
    assert full["choices"][0]["logprobs"]["text_offset"] == [0, 5] and full["choices"][0]["index"] == 1
    assert completion(tok).chunk(HEAD, 0, Delta("a", entries), 0)["choices"][0]["logprobs"] is None
    assert api.usage_chunk(HEAD, {})["object"] == "text_completion"


@pytest.mark.parametrize("raw,code", [(b"{", "invalid_json"), (b"[1]", "invalid_json"),
                                      (b'{"model": "m"}', "missing_parameter")])
def test_bad_bodies_are_400(raw, code):
    err = error_of(lambda: parse_body(raw, ChatCompletionRequest, CHAT_FIELDS))
    assert (err.status, err.code) == (400, code)


def nested(depth: int) -> bytes:
    """A chat body nested ``depth`` levels deep in all: its ``messages`` are ``depth - 1`` lists."""
    return b'{"model": "m", "messages": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 10_000])  # 10,000: past Python's own recursion limit
def test_bodies_nested_past_the_limit_are_400_not_500(depth):
    err = error_of(lambda: parse_body(nested(depth), ChatCompletionRequest, CHAT_FIELDS))
    assert (err.status, err.code) == (400, "invalid_json") and f"deeper than {MAX_JSON_DEPTH}" in err.message
    at_limit = error_of(lambda: parse_body(nested(MAX_JSON_DEPTH), ChatCompletionRequest, CHAT_FIELDS))
    assert at_limit.code != "invalid_json"  # read, then refused for what it says


def object_schema(levels: int) -> dict:
    """A JSON schema of ``levels`` objects each nested in the one before, under an array."""
    schema: dict = {"type": "string"}
    for i in range(levels):
        schema = {"type": "object", "properties": {f"f{i}": {"type": "array", "items": schema}},
                  "required": [f"f{i}"], "additionalProperties": False}
    return schema


def test_deep_but_legitimate_schemas_pass_the_nesting_limit(tok):
    # 10 nested objects is OpenAI's own structured-output limit; each adds 4 levels here (array items)
    schema = object_schema(10)
    api = chat(tok, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert api.body.grammar() is not None
    tool = {"type": "function", "function": {"name": "f", "parameters": object_schema(10)}}
    assert chat(tok, tools=[tool]).body.tools


def test_one_ready_worker_filter_for_lists_and_the_cluster_view():
    infos = [worker("a"), worker("b", state="draining"), worker("c", model="other"),
             worker("d", role="prefill"), worker("e", state="starting")]
    assert [w.worker_id for w in ready_workers(infos, "decode")] == ["a", "c"]
    assert [w.worker_id for w in ready_workers(infos, "decode", "m")] == ["a"]
    assert [w.worker_id for w in ready_workers(infos, "prefill", "m")] == ["d"]
    view = ClusterView()
    view.set_workers(infos)
    assert [e.info.worker_id for e in view.ready_workers("decode")] == ["a", "c"]


def test_status_table_reads_the_typed_page():
    load = WorkerLoad(worker_id="a", role="decode", seq=1, timestamp=0.0, num_running=2,
                      num_blocks_used=3, num_blocks_total=10, ttft_recent_s=0.25, num_remote_prefills=1)
    page = StatusPage.model_validate({
        "source": "autoscaler", "timestamp": 1.0, "gateway": {"in_flight": 2, "models": ["m"], "num_restarts": 1},
        "prefill_queue": {"num_pending": 4, "num_ack_pending": 1},
        "workers": [{"info": worker("a").model_copy(update={"num_restarts": 3}).model_dump(mode="json"),
                     "load": load.model_dump(mode="json")},
                    {"info": worker("d", role="prefill").model_dump(mode="json"), "load": None}]})
    lines = format_status(page).splitlines()
    assert lines[0] == "source: autoscaler   in flight at gateway: 2   gateway restarts: 1"
    assert lines[1] == "prefill queue: 4 waiting, 1 being prefilled, 0 redelivered"
    a, d = lines[3].split(), lines[4].split()
    assert a[:9] == ["a", "decode", "ready", "3", "m", "2", "0", "3/10", "0"]
    assert a[10] == "250.0" and a[12] == "1/0/0"
    assert d[3] == "0" and d[7] == "0/0" and d[12] == "-"
    assert lines[5].endswith("compiled): a eager")  # only workers that reported say how they step
    empty = format_status(StatusPage(timestamp=0.0))
    assert empty.endswith("(no workers registered)")


def test_status_shows_a_kv_tier_line_with_hit_ratios_by_tier():
    tiers = {"host_blocks": 5, "host_capacity_blocks": 64, "disk_blocks": 9, "disk_capacity_blocks": 1000,
             "offloaded_host": 12, "offloaded_disk": 9, "onboarded": 4, "onboarded_disk": 1}
    load = WorkerLoad(worker_id="a", role="decode", seq=1, timestamp=0.0, num_prompt_tokens_total=200,
                      num_cached_prompt_tokens_total=100, kv_tiers=tiers)
    page = StatusPage.model_validate({"timestamp": 1.0, "workers": [
        {"info": worker("a").model_dump(mode="json"), "load": load.model_dump(mode="json")},
        {"info": worker("b").model_dump(mode="json"), "load": None}]})
    tier_lines = [line for line in format_status(page).splitlines() if "KV tiers" in line]
    block = worker("a").block_size  # 4 onboarded blocks, 1 of them from disk
    pool = 100 - 4 * block
    assert tier_lines == [
        "  KV tiers of a: host 5/64 blocks, disk 9/1000 blocks; offloaded 12 to host, 9 to disk; onboarded 4 "
        f"(1 from disk); 0 damaged on disk; prompt tokens from pool {pool / 200:.0%}, host {3 * block / 200:.0%}, "
        f"disk {block / 200:.0%}"]


def test_status_shows_peer_fetches_only_for_workers_that_fetched_or_lent():
    def status(name, **fetch):
        load = WorkerLoad(worker_id=name, role="decode", seq=1, timestamp=0.0, kv_fetch=fetch)
        return {"info": worker(name).model_dump(mode="json"), "load": load.model_dump(mode="json")}

    page = StatusPage.model_validate({"timestamp": 1.0, "workers": [
        status("a", num_fetches=2, num_blocks_fetched=50, num_failed=1, num_skipped=3),
        status("b", num_lent=2, num_blocks_lent=50), status("c", num_skipped=4)]})
    assert [line for line in format_status(page).splitlines() if "peer fetches" in line] == [
        "  KV peer fetches of a: fetched 50 blocks in 2 fetches (1 failed, computed instead; 3 hints not taken); "
        "lent 0 blocks in 0",
        "  KV peer fetches of b: fetched 0 blocks in 0 fetches (0 failed, computed instead; 0 hints not taken); "
        "lent 50 blocks in 2"]


def test_status_lists_every_services_metrics_address():
    page = StatusPage.model_validate({"timestamp": 100.0, "services": [
        {"instance_id": "admission-h-7", "service": "admission", "metrics_url": "http://h:4001/metrics",
         "pid": 7, "started_at": 40.0, "version": "0.1.0"},
        {"instance_id": "w1", "service": "decode", "metrics_url": "http://h:4002/metrics", "num_restarts": 2,
         "pid": 9, "started_at": 90.0},
        {"instance_id": "kv-index-0a1b", "service": "kv-index"}]})  # an older process: no metrics, no start
    lines = format_status(page).splitlines()
    assert lines[-4].split() == ["SERVICE", "PID", "RST", "UP", "s", "VERSION", "INSTANCE", "METRICS"]
    assert lines[-3].split() == ["admission", "7", "0", "60", "0.1.0", "admission-h-7", "http://h:4001/metrics"]
    assert lines[-2].split() == ["decode", "9", "2", "10", "-", "w1", "http://h:4002/metrics"]
    assert lines[-1].split() == ["kv-index", "0", "0", "-", "-", "kv-index-0a1b", "-"]


def test_status_shows_the_autoscalers_decisions_with_their_reasons():
    page = StatusPage.model_validate({"timestamp": 1.0, "scaling": {
        "enabled": True, "last_reason": "cooling down", "recent": [{
            "timestamp": 0.0, "reason": "prefill share 0.97 wanted, have 0.00", "num_prefill": 0, "num_decode": 2,
            "target_prefill": 1, "target_decode": 1, "prefill_tokens_per_s": 1500.4, "decode_tokens_per_s": 3.0,
            "actions": [{"kind": "flip", "worker_id": "d2", "role": "prefill", "ok": True, "message": "draining"}]}]}})
    lines = format_status(page).splitlines()
    assert lines[-2] == "autoscaling: on; last tick: cooling down"
    assert lines[-1].endswith("prefill 0->1, decode 2->1 (1500 prompt tok/s, 3 output tok/s): prefill share 0.97 "
                              "wanted, have 0.00; flip d2 to prefill: ok (draining)")
    scaled = StatusPage.model_validate({"timestamp": 1.0, "scaling": {"enabled": True, "recent": [{
        "timestamp": 0.0, "reason": "utilisation 0.30, 2.0 waiting per worker: scale up to 2", "num_prefill": 0,
        "num_decode": 1, "target_prefill": 0, "target_decode": 2,
        "actions": [{"kind": "start", "worker_id": "d3", "role": "decode", "ok": True, "message": "pid 7"}]}]}})
    assert format_status(scaled).splitlines()[-1].endswith(
        "decode 1->2 (0 prompt tok/s, 0 output tok/s): utilisation 0.30, 2.0 waiting per worker: scale up to 2; "
        "start d3 as decode: ok (pid 7)")
    off = StatusPage.model_validate({"timestamp": 1.0, "scaling": {"enabled": False}})
    assert format_status(off).splitlines()[-1] == "autoscaling: off"


async def test_every_keeps_going_after_a_failed_round():
    rounds: list[int] = []
    third = asyncio.Event()

    async def work() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 3:
            third.set()
        if len(rounds) == 1:
            raise ConnectionError("NATS reconnecting")

    task = asyncio.create_task(every(0.0, work, "test round"))
    await asyncio.wait_for(third.wait(), timeout=5)
    task.cancel()
    assert rounds[:3] == [0, 1, 2]
