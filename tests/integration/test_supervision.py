"""``tandem up``'s supervision on a real Stack (real SmolLM2, ONE decode worker, real NATS and
Redis): a SIGKILLed decode worker comes back, registered and ready, with the restart in the status
view, and the request it was streaming waits for it and completes with the greedy text; a
SIGKILLed admission comes back and requests succeed again; a child that crashes at start-up is
retried with backoff; ``stop()`` restarts nothing.
"""

from __future__ import annotations

import json
import signal
from http.client import HTTPConnection

import pytest

from services.commands.status import format_status
from shared.protocol.status import StatusPage
from services.stack.supervisor import Backoff
from stack_helpers import (cluster_status, greedy_text, read_events, reference_engine_fixture, running_stack,
                           stack_spec, wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 1024
TTL_S = 3.0
RESTART_TIMEOUT_S = 240.0  # a replacement decode worker loads the model and warms up on a busy CPU


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    spec = stack_spec(tmp_path_factory.mktemp("supervised"), "r", nats_server, redis_server, num_decode=1,
                      model=MODEL, registry_ttl_s=TTL_S, restart_children=True,
                      restart_backoff=Backoff(initial_s=0.2, max_s=1.0),
                      decode_flags={"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "128MiB",
                                    "device": "cpu", "num_warmup_requests": 1})
    with running_stack(spec, ready_timeout_s=180) as s:
        yield s


engine = reference_engine_fixture(MODEL, MAX_MODEL_LEN, 128 << 20)


def greedy_reference(engine, prompt: str, max_tokens: int) -> str:
    return greedy_text(engine, engine.tokenizer.encode(prompt), max_tokens, ignore_eos=True)


def completion(stack, prompt: str, max_tokens: int, stream: bool, timeout_s: float = 60.0):
    conn = HTTPConnection("127.0.0.1", stack.port, timeout=timeout_s)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
        "stream": stream, "stream_options": {"include_usage": True} if stream else None}),
        {"Content-Type": "application/json"})
    return conn.getresponse()


def decode_worker(stack) -> dict | None:
    return next((w["info"] for w in cluster_status(stack)["workers"] if w["info"]["role"] == "decode"), None)


def logged(stack, text: str) -> list[str]:
    return [line for line in stack.lines if text in line]


def test_only_decode_worker_sigkilled_mid_stream_comes_back_and_the_stream_completes(stack, engine):
    prompt = "Here is a long list of fruits and vegetables:"
    expected = greedy_reference(engine, prompt, 48)
    victim = stack.children["decode-1"]
    worker_id = decode_worker(stack)["worker_id"]
    # the client's socket timeout covers the replacement's start-up: no byte flows meanwhile
    resp = completion(stack, prompt, 48, stream=True, timeout_s=RESTART_TIMEOUT_S)
    assert resp.status == 200 and resp.getheader("X-Tandem-Worker") == worker_id
    events = read_events(resp, 3)
    victim.proc.send_signal(signal.SIGKILL)
    events += read_events(resp, timeout_s=RESTART_TIMEOUT_S)
    assert [e for e in events if "error" in e] == []

    # One uninterrupted stream, continued by the replacement from the tokens already generated.
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected
    assert events[-1]["usage"]["completion_tokens"] == 48
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"

    replacement = stack.children["decode-1"]
    assert replacement is not victim and replacement.is_running() and stack.num_restarts("decode-1") == 1
    assert logged(stack, "decode-1 exited (signal SIGKILL)") and logged(stack, "decode-1 restarted (restart 1")
    info = wait_for(lambda: (i := decode_worker(stack)) and i["state"] == "ready" and i["pid"] == replacement.pid
                    and i, 30, "the replacement listed as ready")
    assert info["worker_id"] == worker_id and info["num_restarts"] == 1
    page = StatusPage.model_validate({**cluster_status(stack), "source": "test"})
    row = next(line for line in format_status(page).splitlines() if line.startswith(worker_id))
    assert row.split()[:4] == [worker_id, "decode", "ready", "1"]


def test_sigkilled_admission_is_restarted_and_requests_succeed_again(stack, engine):
    expected = greedy_reference(engine, "The capital of France is", 8)
    victim = stack.children["admission"]
    victim.proc.send_signal(signal.SIGKILL)
    wait_for(lambda: stack.children["admission"] is not victim, 30, "admission restarted")
    assert logged(stack, "admission exited (signal SIGKILL)")

    def answer() -> str | None:
        try:
            resp = completion(stack, "The capital of France is", 8, stream=False)
        except OSError:
            return None
        body = resp.read()
        return json.loads(body)["choices"][0]["text"] if resp.status == 200 else None

    assert wait_for(answer, 120, "a completion after admission's restart") == expected
    assert stack.num_restarts("admission") == 1 and stack.children["admission"].is_running()


def test_a_child_crashing_at_start_up_is_retried_with_backoff(stack):
    # admission refuses a QoS file that does not exist: exit code 2 at start-up, every time
    stack.spawn("crashy", "admission", {"nats_url": stack.nats_url, "namespace": stack.spec.namespace,
                                        "qos": "/nonexistent/qos.yaml"})
    wait_for(lambda: logged(stack, "crashy exited (exit code 2)") and stack.num_restarts("crashy") >= 3,
             120, "three restarts of a child that crashes at start-up")
    lines = logged(stack, "crashy exited (exit code 2)")
    assert "; restart 1 in 0.2s" in lines[0]
    assert "; restart 2 in 0.4s, 2 crashes in a row" in lines[1]
    assert "; restart 3 in 0.8s, 3 crashes in a row" in lines[2]


def test_stop_restarts_nothing(stack):
    """Last: it stops the stack."""
    since = len(stack.lines)
    stack.stop()
    assert not any(c.is_running() for c in stack.children.values())
    # the supervisor saw none of stop()'s exits (crashy may have crashed once more before it)
    seen = [line for line in stack.lines[since:] if line.startswith("up|") and "crashy" not in line
            and ("exited (" in line or "restarted" in line)]
    assert seen == []
