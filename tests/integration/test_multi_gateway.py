"""Two gateways and two admissions side by side (``tandem up --gateways 2 --admissions 2``) on a
real Stack (real SmolLM2, one decode worker, real NATS and Redis, supervision on): a SIGKILLed
gateway fails only the stream it was serving, the other keeps serving, and the supervisor brings
the dead one back on its port; an admission that dies holding requests fails none of them (the
gateway asks again on the queue group and the other instance answers).
"""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection

import pytest

from loadtest.tools.harness import is_healthy
from services.cli import main
from services.stack.supervisor import Backoff
from stack_helpers import (cluster_status, greedy_text, read_events, reference_engine_fixture, running_stack,
                           stack_spec, wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    spec = stack_spec(tmp_path_factory.mktemp("multi"), "m", nats_server, redis_server, num_decode=1, num_gateways=2,
                      num_admissions=2, model=MODEL, registry_ttl_s=3.0, restart_children=True,
                      restart_backoff=Backoff(initial_s=0.2, max_s=1.0),
                      decode_flags={"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "128MiB",
                                    "device": "cpu", "num_warmup_requests": 1})
    with running_stack(spec, ready_timeout_s=180) as s:
        yield s


engine = reference_engine_fixture(MODEL, MAX_MODEL_LEN, 128 << 20)


def completion(port: int, prompt: str, max_tokens: int, stream: bool = False, timeout_s: float = 120.0):
    conn = HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
        "stream": stream}), {"Content-Type": "application/json"})
    return conn.getresponse()


def text_of(port: int, prompt: str, max_tokens: int) -> tuple[int, str]:
    resp = completion(port, prompt, max_tokens)
    body = json.loads(resp.read())
    return resp.status, body["choices"][0]["text"] if resp.status == 200 else json.dumps(body)


def test_each_gateway_on_its_port_and_status_lists_them(stack, capsys):
    assert len(stack.ports) == 2 and all(is_healthy(p) for p in stack.ports)
    assert {"gateway", "gateway-2", "admission", "admission-2"} <= set(stack.children)
    assert cluster_status(stack)["gateway"]["urls"] == stack.base_urls
    assert main(["status", "--url", stack.base_urls[1]]) == 0
    out = capsys.readouterr().out
    assert f"gateways: {stack.base_urls[0]} (up)  {stack.base_urls[1]} (up)" in out


def test_sigkilled_gateway_fails_only_its_stream_and_comes_back(stack, engine):
    prompt = "Here is a long list of fruits and vegetables:"
    expected = greedy_text(engine, engine.tokenizer.encode(prompt), 48, ignore_eos=True)
    first, second = stack.ports
    since = len(stack.lines)
    survivor_stream = completion(first, prompt, 48, stream=True)
    # long enough to be running still when the worker sees its gateway gone
    victim_stream = completion(second, prompt, MAX_MODEL_LEN - 64, stream=True)
    assert survivor_stream.status == 200 and victim_stream.status == 200
    read_events(victim_stream, 2)
    events = read_events(survivor_stream, 2)
    victim = stack.children["gateway-2"]
    victim.proc.send_signal(signal.SIGKILL)

    with pytest.raises((OSError, AssertionError)):  # reset, or the stream ends without [DONE]
        read_events(victim_stream, 48)
    events += read_events(survivor_stream)
    assert [e for e in events if "error" in e] == []
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected
    assert text_of(first, "The capital of France is", 8)[0] == 200  # new requests on the other one
    # the orphan the dead gateway left on the worker is aborted, not generated to the end
    wait_for(lambda: any("is gone" in line and "aborting its 1 requests" in line for line in stack.lines[since:]), 30,
             "the decode worker aborting the dead gateway's request")
    wait_for(lambda: all(w["load"] and w["load"]["num_running"] == 0 for w in cluster_status(stack)["workers"]), 30,
             "no request running on the decode worker")

    wait_for(lambda: stack.children["gateway-2"] is not victim and is_healthy(second), 120,
             "gateway-2 restarted and healthy on its port")
    assert stack.num_restarts("gateway-2") == 1
    assert wait_for(lambda: text_of(second, prompt, 48), 60, "a completion on the restarted gateway") == \
        (200, expected)


def test_admission_dying_with_requests_in_hand_fails_none(stack, engine):
    prompts = [f"Question {i}: the capital of France is" for i in range(8)]
    expected = [greedy_text(engine, engine.tokenizer.encode(p), 16, ignore_eos=True) for p in prompts]
    victim = stack.children["admission-2"]
    since = len(stack.lines)
    # Stopped, admission-2 stays in the queue group (its connection is open) and takes about half
    # of the asks without answering; killed once the first request is answered (every ask has been
    # sent by then), it dies with those asks in hand.
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = [pool.submit(text_of, stack.ports[0], p, 16) for p in prompts]
            wait_for(lambda: any(a.done() for a in answers), 120, "a first answer")
            victim.proc.send_signal(signal.SIGKILL)
            results = [a.result(timeout=180) for a in answers]
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    assert results == [(200, text) for text in expected]
    # the test did what it says: asks went to the dying instance (1 in 2**8 runs sends none there)
    assert any("asking again" in line for line in stack.lines[since:])
    wait_for(lambda: stack.children["admission-2"] is not victim, 60, "admission-2 restarted")


def test_restarts_of_every_service_show_in_status(stack, capsys):
    """After the kills above (gateway-2, admission-2) and of kv-index and the autoscaler here, the
    status view lists every service process with its supervisor's restart count."""
    for name in ("kv-index", "autoscaler"):
        victim = stack.children[name]
        victim.proc.send_signal(signal.SIGKILL)
        wait_for(lambda: stack.children[name] is not victim, 60, f"{name} restarted")
    want = {("gateway", 0), ("gateway", 1), ("admission", 0), ("admission", 1), ("kv-index", 1), ("autoscaler", 1)}

    def listed() -> set | None:  # a killed process's entry stays until it expires (registry_ttl_s)
        got = sorted((s["service"], s["num_restarts"]) for s in cluster_status(stack)["services"]
                     if s["service"] in {name for name, _ in want})  # the workers are listed too
        return got == sorted(want) and got

    wait_for(listed, 120, f"the status view listing {sorted(want)}")
    assert main(["status", "--url", stack.base_url]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert sorted((r[0], int(r[2])) for r in rows if r and r[0] in {s for s, _ in want}) == sorted(want)


def test_stored_responses_are_served_by_either_gateway_and_outlive_restarts_of_both(stack):
    """A response stored through gateway 1 is read and continued (``previous_response_id``) through
    gateway 2, a background response started on one is cancelled on the other, and after both
    gateways are SIGKILLed and restarted by the supervisor every stored response reads back the same
    and the chain continues. (Placed last: it restarts both gateways, which the restart counts of
    the test above would otherwise see.)"""
    import openai

    one, two = (openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
                for url in stack.base_urls)
    first = one.responses.create(model=MODEL, input="My name is Ada. Say hello to me.", max_output_tokens=6,
                                 temperature=0)
    assert two.responses.retrieve(first.id).output_text == first.output_text
    second = two.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens

    running = one.responses.create(model=MODEL, input="Count to a thousand.", max_output_tokens=900,
                                   background=True, extra_body={"ignore_eos": True})
    wait_for(lambda: two.responses.retrieve(running.id).status == "in_progress", 60, "the background response to start")
    assert two.responses.cancel(running.id).status == "cancelled"
    wait_for(lambda: all(w["load"] and w["load"]["num_running"] == 0 for w in cluster_status(stack)["workers"]), 30,
             "the response cancelled on gateway 2 to stop running on the worker gateway 1 sent it to")

    victims = {name: stack.children[name] for name in ("gateway", "gateway-2")}
    for victim in victims.values():
        victim.proc.send_signal(signal.SIGKILL)
    wait_for(lambda: all(stack.children[n] is not v for n, v in victims.items()) and all(map(is_healthy, stack.ports)),
             120, "both gateways restarted and healthy on their ports")

    for client in (one, two):
        assert [client.responses.retrieve(r.id).output_text for r in (first, second)] == \
            [first.output_text, second.output_text]
        assert client.responses.retrieve(running.id).status == "cancelled"
    third = one.responses.create(model=MODEL, input="Say it again.", previous_response_id=second.id,
                                 max_output_tokens=4, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens
    assert [i.content[0].text for i in two.responses.input_items.list(third.id).data] == ["Say it again."]
