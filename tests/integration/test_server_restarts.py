"""The stack rides through a restart of its servers (real SmolLM2, one decode worker, the stack's own
embedded nats-server and redis-server, which its supervisor restarts on the same port and data):

- nats-server SIGKILLed mid-stream: the stream in flight ends (here: completes with the fault-free
  text, continued from the tokens received), and new requests succeed once it is back;
- redis-server SIGKILLed under load: every request meanwhile succeeds (routing on load alone), and
  the kv-index rebuilds the index from the KV event stream: it holds the worker's blocks again.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from http.client import HTTPConnection

import pytest

from services.stack.stack import StackSpec
from services.stack.supervisor import Backoff
from shared.store import KvIndexStore, RedisKeys, connect
from stack_helpers import cluster_status, read_events, running_stack, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
BACK_WITHIN_S = 60.0   # a bound for "serving again", generous for a loaded CPU; not a timing claim
STREAM_END_S = 180.0   # the stream in flight at the kill must end by then


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    spec = StackSpec(state_dir=tmp_path_factory.mktemp("servers"), num_decode=1, model=MODEL, port=0,
                     namespace=f"b{uuid.uuid4().hex[:8]}", registry_ttl_s=3.0, restart_children=True,
                     restart_backoff=Backoff(initial_s=0.2, max_s=1.0),
                     decode_flags={"max_model_len": 1024, "kv_cache_memory": "128MiB", "device": "cpu",
                                   "num_warmup_requests": 1})
    with running_stack(spec, ready_timeout_s=180) as s:
        yield s


def server(stack, name: str):
    return next(s for s in stack.servers if s.name == name)


def completion(stack, prompt: str, max_tokens: int, stream: bool = False, timeout_s: float = 60.0):
    conn = HTTPConnection("127.0.0.1", stack.port, timeout=timeout_s)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
        "stream": stream}), {"Content-Type": "application/json"})
    return conn.getresponse()


def text_of(stack, prompt: str, max_tokens: int) -> str:
    resp = completion(stack, prompt, max_tokens)
    body = resp.read()
    assert resp.status == 200, (resp.status, body[:300])
    return json.loads(body)["choices"][0]["text"]


def logged(stack, text: str) -> list[str]:
    return [line for line in stack.lines if text in line]


def decode_worker_id(stack) -> str:
    """The decode worker's id, once /status lists it (right after the stack is ready, the process
    that answers /status may not have read the registry yet)."""
    return wait_for(lambda: next((w["info"]["worker_id"] for w in cluster_status(stack)["workers"]
                                  if w["info"]["role"] == "decode"), None), 30, "the decode worker in /status")


def test_nats_server_killed_mid_stream_restarts_and_the_stack_serves_again(stack):
    prompt = "Here is a long list of fruits and vegetables:"
    expected = text_of(stack, prompt, 64)  # the fault-free greedy text, from this stack
    nats = server(stack, "nats-server")
    resp = completion(stack, prompt, 64, stream=True, timeout_s=STREAM_END_S)
    assert resp.status == 200
    events = read_events(resp, 2)
    nats.proc.kill()
    killed_pid = nats.proc.pid
    events += read_events(resp, timeout_s=STREAM_END_S)  # it ends: with an error event or the rest
    assert [e for e in events if "error" in e] == []
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected

    wait_for(lambda: logged(stack, "nats-server restarted (restart 1"), BACK_WITHIN_S, "nats-server restarted")
    assert nats.pid != killed_pid and nats.is_running()
    assert logged(stack, "nats-server exited (signal SIGKILL)")
    # nats-py would re-create these consumers itself, but only after missing heartbeats for 10 s
    for service, what in (("gateway", "registry watch"), ("admission", "registry watch"),
                          ("kv-index", "replay of")):
        wait_for(lambda: [line for line in stack.lines if line.startswith(f"{service}|") and what in line
                          and line.endswith("resumed")], BACK_WITHIN_S, f"{service} resuming its {what}")

    took: list[float] = []

    def answered():
        started = time.monotonic()
        resp = completion(stack, "The capital of France is", 8)
        took.append(time.monotonic() - started)
        return resp.status == 200 and json.loads(resp.read())["choices"][0]["text"]

    back = time.monotonic()
    assert wait_for(answered, BACK_WITHIN_S, "a completion after the nats-server restart") == \
        text_of(stack, "The capital of France is", 8)
    print(f"first success {time.monotonic() - back:.1f}s after the stream ended ({len(took)} tries, "
          f"the last took {took[-1]:.1f}s)")


def test_redis_killed_under_load_fails_no_request_and_the_index_is_rebuilt(stack):
    worker_id = decode_worker_id(stack)
    text_of(stack, "A shared document about block routing and caches. " * 8, 4)  # blocks to index

    async def indexed():
        return await _index(stack, worker_id)

    before = asyncio.run(_wait(indexed, "the worker's blocks in the index before the fault"))
    failures: list[object] = []
    done: list[int] = []
    stop = threading.Event()

    def load(i: int) -> None:
        while not stop.is_set():
            try:
                resp = completion(stack, f"Request {i}: a shared document about block routing. " * 4, 4)
                body = resp.read()
                if resp.status != 200:
                    failures.append((resp.status, body[:200]))
            except OSError as exc:  # the gateway hanging up counts as a failure too
                failures.append(repr(exc))
            done.append(i)

    senders = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    for t in senders:
        t.start()
    try:
        wait_for(lambda: len(done) >= 3, BACK_WITHIN_S, "requests under way")
        redis = server(stack, "redis-server")
        redis.proc.kill()
        wait_for(lambda: logged(stack, "redis-server restarted (restart 1"), BACK_WITHIN_S, "redis-server restarted")
        after_restart = len(done)
        wait_for(lambda: len(done) >= after_restart + 3, BACK_WITHIN_S, "requests after the restart")
    finally:
        stop.set()
        for t in senders:
            t.join(STREAM_END_S)
    assert failures == []

    async def rebuilt():
        held = await _index(stack, worker_id)
        return held >= before and held

    assert asyncio.run(_wait(rebuilt, "the index holding the worker's blocks again")) >= before


async def _index(stack, worker_id: str) -> set[int]:
    """Block hashes the index lists ``worker_id`` as holding (in the worker's set and as an owner)."""
    redis = connect(stack.redis_url)
    try:
        keys = RedisKeys(stack.spec.namespace)
        members = await redis.smembers(keys.worker_blocks(worker_id))
        hashes = {int(m.partition("@")[0]) for m in members}
        store = KvIndexStore(redis, keys)
        return {h for h in hashes if worker_id in await store.owners(h)}
    finally:
        await redis.aclose()


async def _wait(check, what: str):
    from services.stack.waiting import wait_until

    return await wait_until(check, timeout_s=BACK_WITHIN_S, interval_s=0.2, what=what)
