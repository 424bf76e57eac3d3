"""The whole stack as separate processes (two decode workers on the real SmolLM2) against real
nats-server and redis-server, driven through the official ``openai`` client and raw HTTP.

One stack per module (model loads dominate the time). The tests that take a decode worker away
(SIGKILL, SIGTERM drain) start their own; only the last one stops the stack's workers.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
import uuid

import openai
import pytest

from shared.kvcache.hashing import hash_blocks, make_namespace
from shared.protocol import Subjects
from services.stack.waiting import wait_until
from shared.store import KvIndexStore, RedisKeys, connect
from shared.telemetry.metrics import sample_total
from stack_helpers import (decode_states, greedy_text, read_events, reference_engine_fixture, running_stack,
                           spawn_ready_decode, stack_spec, wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 1024
TTL_S = 3.0


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    spec = stack_spec(tmp_path_factory.mktemp("stack"), "s", nats_server, redis_server, num_decode=2, model=MODEL,
                      registry_ttl_s=TTL_S,
                      decode_flags={"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "128MiB",
                                    "device": "cpu", "num_warmup_requests": 2, "drain_timeout_s": 60},
                      admission_flags={"log_level": "DEBUG"})
    with running_stack(spec, ready_timeout_s=180) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


engine = reference_engine_fixture(MODEL, MAX_MODEL_LEN, 128 << 20)


def http(stack, method, path, body: bytes | None = None, headers=None):
    req = urllib.request.Request(stack.base_url + path, data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def status(stack) -> dict:
    return json.loads(http(stack, "GET", "/status")[2])


def in_process_greedy(engine, prompt_ids, max_tokens, ignore_eos=False):
    return greedy_text(engine, prompt_ids, max_tokens, ignore_eos)


MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three colours of the rainbow."}]


def test_openai_client_gets_the_in_process_greedy_text(client, engine):
    tok = engine.tokenizer
    chat_ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    expected_chat = in_process_greedy(engine, chat_ids, 24)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == expected_chat
    assert reply.usage.prompt_tokens == len(chat_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_chat
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens

    prompt = "The three primary colours are"
    expected_text = in_process_greedy(engine, tok.encode(prompt), 16)
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                     temperature=0).choices[0].text == expected_text
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected_text


def test_stop_strings_logprobs_models_and_metrics(client, stack):
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text.strip()[:2]
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                    stop=[stop], logprobs=2)
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert len(cut.choices[0].logprobs.top_logprobs[0]) == 2
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=3)
    entry = chat.choices[0].logprobs.content[0]
    assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
    assert [m.id for m in client.models.list()] == [MODEL]
    code, _, body = http(stack, "GET", "/metrics")
    metrics = body.decode()
    assert code == 200 and sample_total(metrics, "tandem_gateway_requests_total", status="200") >= 4
    assert sample_total(metrics, "tandem_gateway_ttft_seconds_count") >= 3
    assert sample_total(metrics, "tandem_gateway_itl_seconds_count") > 0
    assert http(stack, "GET", "/health")[0] == 200


def test_status_view_and_cli(stack, capsys):
    from services.cli import main

    view = status(stack)
    assert sorted(w["info"]["state"] for w in view["workers"]) == ["ready", "ready"]
    assert main(["status", "--url", stack.base_url]) == 0
    out = capsys.readouterr().out
    assert out.count(" decode ") == 2 and "KV USED" in out


def plant_prefix(stack, worker_id: str, prompt_ids: list[int]) -> None:
    """Run one request on ``worker_id`` directly (not through admission), so it holds the prefix."""
    from shared.bus import Bus
    from shared.protocol import GenerateRequest, SamplingParams

    async def run():
        bus = await Bus.connect(stack.nats_url, "test-plant")
        try:
            request = GenerateRequest(request_id=f"plant-{uuid.uuid4().hex}", model=MODEL,
                                      prompt_token_ids=prompt_ids,
                                      sampling=SamplingParams(max_tokens=2, temperature=0.0))
            return [c async for c in bus.stream(Subjects(stack.spec.namespace).decode_generate(worker_id),
                                                request, first_timeout_s=60, idle_timeout_s=60)]
        finally:
            await bus.close()

    chunks = asyncio.run(run())
    assert chunks and chunks[-1].finish_reason == "length", chunks


def admission_choice(stack, request_id: str) -> tuple[str, int]:
    """(worker, overlap blocks) as admission logged its choice for ``request_id`` (at DEBUG)."""
    pattern = re.compile(rf"{re.escape(request_id)} → (\S+) \(cost [-\d.]+, overlap (\d+)/\d+ blocks")

    def logged():
        return next((m for line in list(stack.lines) if (m := pattern.search(line))), None)

    match = wait_for(logged, 10, f"admission's log line for {request_id}")
    return match.group(1), int(match.group(2))


def test_prefix_goes_to_the_worker_that_holds_it(stack, client, engine):
    """The prefix is planted on the worker that would lose a tie (ties go to the lower worker id),
    so only the overlap admission sees can send the follow-ups there: a wrong hash, block size or
    namespace anywhere between gateway, kv-index and admission sends them to the other worker."""
    tok = engine.tokenizer
    prefix = "Here is a long shared document about routing. " * 20
    ids = tok.encode(prefix + "Question one?")
    hashes = hash_blocks(ids, 16, make_namespace(engine.model_id))
    assert len(hashes) >= 8
    ready = sorted(w for w, state in decode_states(stack).items() if state == "ready")
    assert len(ready) >= 2, f"the routing test needs two ready decode workers: {ready}"
    owner = ready[-1]
    plant_prefix(stack, owner, ids)

    async def owners_in_redis():
        redis = connect(stack.redis_url)
        store = KvIndexStore(redis, RedisKeys(stack.spec.namespace))
        try:
            return await wait_until(lambda: _owners(store, hashes[:8]), timeout_s=10,
                                    what=f"kv-index listing {owner} for the prefix")
        finally:
            await redis.aclose()

    assert asyncio.run(owners_in_redis()) == [{owner}] * 8
    for question in ("Question two?", "Question three?", "Question four?"):
        again = client.completions.with_raw_response.create(model=MODEL, prompt=prefix + question,
                                                            max_tokens=2, temperature=0)
        chosen, num_overlap = admission_choice(stack, again.headers["x-request-id"])
        assert (again.headers["x-tandem-worker"], chosen) == (owner, owner), f"overlap {num_overlap}"
        assert num_overlap >= 8
        assert again.parse().usage.prompt_tokens_details.cached_tokens >= 8 * 16


async def _owners(store, hashes) -> list[set[str]] | None:
    found = [await store.owners(h) for h in hashes]
    return found if all(found) else None


def test_client_disconnect_frees_the_workers_blocks(stack):
    from http.client import HTTPConnection

    conn = HTTPConnection("127.0.0.1", stack.port, timeout=60)
    body = json.dumps({"model": MODEL, "prompt": "Count slowly: one, two,", "max_tokens": 900,
                       "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    worker = resp.getheader("X-Tandem-Worker")
    for _ in range(5):
        assert resp.readline()  # a few SSE lines: the request is running
    conn.sock.shutdown(2)
    conn.close()

    def freed():
        load = next(w["load"] for w in status(stack)["workers"] if w["info"]["worker_id"] == worker)
        if load and load["num_running"] == 0 and load["num_blocks_used"] == 0 and load["num_requests_aborted"]:
            return load
        return None

    load = wait_for(freed, 15, f"worker {worker} to drop the aborted request")
    assert load["num_generated_tokens_total"] < 900 + 200


BAD_INPUT = [
    ("malformed JSON", "/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [', 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("invalid UTF-8", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "\xff\xfe"}', 400, None),
    ("empty body", "/v1/chat/completions", b"", 400, None),
    ("missing messages", "/v1/chat/completions", b'{"model": "smollm2-135m"}', 400, "messages"),
    ("empty messages", "/v1/chat/completions", b'{"model": "smollm2-135m", "messages": []}', 400, "messages"),
    ("wrong type", "/v1/chat/completions",
     b'{"model": "smollm2-135m", "messages": "hello"}', 400, "messages"),
    ("unknown role", "/v1/chat/completions",
     b'{"model": "smollm2-135m", "messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages.0.role"),
    ("unknown model", "/v1/chat/completions",
     b'{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
    ("prompt over the context", "/v1/completions",
     json.dumps({"model": MODEL, "prompt": "word " * 1500}).encode(), 400, "prompt"),
    ("chat over the context", "/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 1500}]}).encode(),
     400, "messages"),
    ("absurd max_tokens", "/v1/completions",
     b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 10000000}', 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions",
     b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": -1}', 400, "max_tokens"),
    ("temperature out of range", "/v1/chat/completions",
     b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}',
     400, "temperature"),
    ("top_p out of range", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "top_p": 1.5}',
     400, "top_p"),
    ("n over the limit", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "n": 17}', 400, "n"),
    ("unknown parameter", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "nn": 3}', 400, "nn"),
    ("token id out of vocab", "/v1/completions",
     b'{"model": "smollm2-135m", "prompt": [1, 99999999]}', 400, "prompt"),
    ("empty prompt", "/v1/completions", b'{"model": "smollm2-135m", "prompt": ""}', 400, "prompt"),
    ("unknown route", "/v1/embeddings", b"{}", 404, None),
]


@pytest.mark.parametrize("path,body,code,param", [b[1:] for b in BAD_INPUT], ids=[b[0] for b in BAD_INPUT])
def test_bad_input_is_a_4xx_in_openai_format(stack, path, body, code, param):
    got, _, raw = http(stack, "POST", path, body)
    assert got == code, raw
    error = json.loads(raw)["error"]
    assert error["message"] and error["type"]
    if param:
        assert error["param"] == param, error


def test_bad_messages_on_subjects_get_error_replies(stack):
    async def probe():
        from shared.bus import Bus

        bus = await Bus.connect(stack.nats_url, "probe")
        try:
            subjects = Subjects(stack.spec.namespace)
            worker = status(stack)["workers"][0]["info"]["worker_id"]
            for subject in (subjects.decode_generate(worker).subject, subjects.admission_submit().subject,
                            subjects.kvindex_match().subject):
                msg = await bus.nc.request(subject, b'{"nonsense": true', timeout=5)
                assert msg.headers["Tandem-Error-Code"] == "bad_request", subject
            await bus.nc.publish(subjects.kv_events(worker).subject, b"garbage")
            await bus.nc.publish(subjects.decode_cancel(worker).subject, b"{}")
        finally:
            await bus.close()

    asyncio.run(probe())
    assert http(stack, "GET", "/ready")[0] == 200
    assert all(c.is_running() for c in stack.children.values())


def metric(stack, name: str) -> float:
    """The value of the gateway's sample ``name`` (0 if absent)."""
    return sample_total(http(stack, "GET", "/metrics")[2].decode(), name) or 0.0


def stream_completion(stack, prompt: str, max_tokens: int):
    from http.client import HTTPConnection

    conn = HTTPConnection("127.0.0.1", stack.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.connection = conn
    return resp


def stream_on(stack, worker_id: str, prompt: str, max_tokens: int, timeout_s: float = 30.0):
    """A streamed completion admitted to ``worker_id``. A new idle worker wins the routing tie once
    admission's view lists it, which can be a refresh (0.5 s) after it shows as ready in /status;
    until then a stream that lands elsewhere is disconnected (the gateway cancels it) and sent again."""
    def attempt():
        resp = stream_completion(stack, prompt, max_tokens)
        if resp.getheader("X-Tandem-Worker") == worker_id:
            return resp
        resp.connection.sock.shutdown(2)
        resp.connection.close()
        return None

    return wait_for(attempt, timeout_s, f"a stream admitted to {worker_id}")


def test_sigkilled_worker_mid_stream_is_replaced_and_leaves_registry_and_index(stack, client, engine):
    # A worker of its own, named to win the tie among idle workers (stream_on waits until it does).
    victim, victim_id = spawn_ready_decode(stack, "decode-0-victim")
    migrations = metric(stack, "tandem_gateway_migrations_total")
    prompt = "Here is a long list of fruits and vegetables:"
    expected = in_process_greedy(engine, engine.tokenizer.encode(prompt), 40, ignore_eos=True)
    resp = stream_on(stack, victim_id, prompt, 40)
    events = read_events(resp, 3)
    victim.kill()
    events += read_events(resp)
    # One uninterrupted stream: the survivor continued from the tokens already generated.
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected
    assert events[-1]["usage"]["completion_tokens"] == 40
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"

    async def index_workers():
        redis = connect(stack.redis_url)
        try:
            return set(await KvIndexStore(redis, RedisKeys(stack.spec.namespace)).workers())
        finally:
            await redis.aclose()

    wait_for(lambda: victim_id not in decode_states(stack) and victim_id not in asyncio.run(index_workers()),
             4 * TTL_S, f"{victim_id} gone from the registry and the index after SIGKILL")
    for _ in range(3):
        reply = client.completions.with_raw_response.create(model=MODEL, prompt="warm the index " * 20,
                                                            max_tokens=1)
        assert reply.headers["x-tandem-worker"] not in ("", victim_id)
    assert metric(stack, "tandem_gateway_migrations_total") == migrations + 1


def test_sigterm_drains_in_flight_work_then_deregisters(stack, client):
    drained, drained_id = spawn_ready_decode(stack, "decode-0-drain")
    resp = stream_on(stack, drained_id, "Tell a story:", 300)
    events = read_events(resp, 1)
    drained.terminate()
    # Listed as draining while the request runs (the entry goes once in-flight work is done).
    wait_for(lambda: decode_states(stack).get(drained_id) == "draining", 30, f"{drained_id} draining")
    other = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=1)
    assert other.headers["x-tandem-worker"] not in ("", drained_id)
    events += read_events(resp)
    assert events[-1]["usage"]["completion_tokens"] == 300
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert drained.wait(30) and drained.proc.returncode == 0
    # The worker deleted its entry before exiting: the key holds a delete marker now (an entry left
    # to expire would still hold the worker's info, or nothing once its TTL passed). Admission's
    # view, which /status shows, drops it at its next refresh of the registry.
    assert asyncio.run(registry_operation(stack, drained_id)) in ("DEL", "PURGE")
    wait_for(lambda: drained_id not in decode_states(stack), 5, f"{drained_id} gone from /status")


async def registry_operation(stack, worker_id: str) -> str | None:
    """The operation of the registry key's latest entry: PUT, DEL or PURGE, None if there is none."""
    import nats
    from nats.js.errors import KeyNotFoundError

    nc = await nats.connect(stack.nats_url)
    try:
        kv = await nc.jetstream().key_value(Subjects(stack.spec.namespace).workers_bucket)
        try:
            return (await kv.get(worker_id)).operation or "PUT"
        except KeyNotFoundError as exc:  # nats-py reports a delete marker so too, with its op
            return exc.op
    finally:
        await nc.close()


def test_a_decode_worker_refuses_a_text_request_with_bad_request(stack):
    """A request meant for a text worker (prompt text, no token ids) sent to a token worker."""
    from shared.bus import Bus, RemoteError
    from shared.protocol import GenerateRequest

    worker_id = next(w for w, state in decode_states(stack).items() if state == "ready")

    async def ask() -> RemoteError:
        bus = await Bus.connect(stack.nats_url, "text-to-token-worker")
        try:
            stream = bus.stream(Subjects(stack.spec.namespace).decode_generate(worker_id),
                                GenerateRequest(request_id="text-1", model=MODEL, prompt_text="hello"),
                                first_timeout_s=30, idle_timeout_s=30)
            with pytest.raises(RemoteError) as err:
                await anext(stream)
            return err.value
        finally:
            await bus.close()

    err = asyncio.run(ask())
    assert (err.code, err.field) == ("bad_request", "prompt_token_ids") and "not text" in err.message


def test_the_decode_worker_passes_worker_check_drain_included(stack):
    """``tandem worker-check`` as a user runs it, against a real decode worker on the real model;
    ``--drain`` ends with the worker deregistered and exited."""
    import subprocess
    import sys

    checked, checked_id = spawn_ready_decode(stack, "decode-0-check")
    out = subprocess.run([sys.executable, "-m", "services.cli", "worker-check", checked_id, "--nats-url",
                          stack.nats_url, "--namespace", stack.spec.namespace, "--drain"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "7 passed, 0 failed, 0 skipped", out.stdout
    assert "PASS  drain and deregistration: states ready → draining → deleted" in lines, out.stdout
    assert checked.wait(60) and checked.proc.returncode == 0


def test_without_decode_workers_the_gateway_answers_503(stack):
    """Last: it takes the stack's decode workers away."""
    workers = [c for n, c in stack.children.items() if n.startswith("decode") and c.is_running()]
    for child in workers:
        child.terminate()
    assert all(child.wait(60) for child in workers)
    wait_for(lambda: http(stack, "GET", "/ready")[0] == 503, 5, "/ready 503 with no decode worker")
    code, headers, raw = http(stack, "POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode())
    assert code == 503 and "Retry-After" in headers, raw
