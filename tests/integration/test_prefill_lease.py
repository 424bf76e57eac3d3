"""Blocks a decode worker reserved for a prefill worker that died or hangs come back within seconds
(the prefill worker's lease on them lapses), not at the end of the remote-prefill window, and the
request completes with the greedy text by a local prefill; a hung prefill worker that wakes up is
refused and never writes into the blocks. Real processes: SmolLM2, nats-server, redis-server, NIXL.

The window (``remote_prefill_timeout_s``) is FALLBACK_S, far beyond every deadline below: a test
that passes did not wait it out.
"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.request import urlopen

import openai
import pytest

from stack_helpers import greedy_text, reference_engine_fixture, require_nixl, running_stack, stack_spec, wait_for

require_nixl()

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 2048
FALLBACK_S = 900.0
# for the request and for the blocks: a lapsed lease (seconds), not the window, ends the wait; the
# rest is the local prefill of a long prompt on a busy CPU
DEADLINE_S = 240.0
ENGINE = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "160MiB", "device": "cpu", "num_warmup_requests": 1}
LONG_DOC = ("Tandem moves the KV cache of long prompts from prefill workers to decode workers. "
            "Each block of sixteen tokens holds every layer's keys and values. ") * 14


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    spec = stack_spec(tmp_path_factory.mktemp("lease"), "l", nats_server, redis_server, num_decode=1, num_prefill=1,
                      model=MODEL, registry_ttl_s=3.0,
                      decode_flags={**ENGINE, "max_local_prefill_tokens": 0, "remote_prefill_timeout_s": FALLBACK_S},
                      prefill_flags={**ENGINE, "ack_wait_s": 3.0})
    with running_stack(spec, ready_timeout_s=240) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=FALLBACK_S)


engine = reference_engine_fixture(MODEL, MAX_MODEL_LEN, 160 << 20)


def decode_load(stack) -> dict:
    with urlopen(stack.base_url + "/status", timeout=10) as resp:
        view = json.load(resp)
    return next(w["load"] for w in view["workers"] if w["info"]["role"] == "decode" and w["load"])


def logged(stack, child: str, request_id: str, text: str) -> list[str]:
    return [l for l in stack.lines if l.startswith(f"{child}|") and f"{request_id}: {text}" in l]


def start_long_request(stack, client, engine, question: str) -> tuple[Future, str, list[int]]:
    """A long prompt sent in the background, once the prefill worker started on it: (reply, its
    request id, the prompt's ids)."""
    prompt = (LONG_DOC * 4)[:5200] + question
    ids = engine.tokenizer.encode(prompt)
    pool = ThreadPoolExecutor(1)
    reply = pool.submit(lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                          temperature=0))
    pool.shutdown(wait=False)
    line = wait_for(lambda: next((l for l in stack.lines if l.startswith("prefill-1|")
                                  and f"prefilling {len(ids)} tokens" in l), None), 120,
                    f"the prefill worker starting on {len(ids)} tokens")
    return reply, line.split(": ")[1], ids


def wait_for_blocks_back(stack) -> dict:
    return wait_for(lambda: (l := decode_load(stack))["num_blocks_used"] == 0 and l["num_held"] == 0 and l,
                    DEADLINE_S, "the decode worker's blocks back in the pool (0 used, 0 held)")


def test_a_hung_prefill_worker_is_given_up_and_refused_when_it_wakes(stack, client, engine):
    reply, request_id, ids = start_long_request(stack, client, engine, "Which component receives the blocks?")
    pid = stack.children["prefill-1"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        assert reply.result(timeout=DEADLINE_S).choices[0].text == greedy_text(engine, ids, 24)
        assert logged(stack, "decode-1", request_id, "the prefill worker's lease lapsed")
        wait_for_blocks_back(stack)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: logged(stack, "prefill-1", request_id, "dropped"), DEADLINE_S,
             "the woken prefill worker dropping the request")
    assert not logged(stack, "prefill-1", request_id, "wrote")


def test_a_killed_prefill_workers_blocks_come_back_and_the_request_completes(stack, client, engine):
    """Last: the stack has no prefill worker afterwards."""
    reply, request_id, ids = start_long_request(stack, client, engine, "What is this text about?")
    stack.children["prefill-1"].kill()
    assert reply.result(timeout=DEADLINE_S).choices[0].text == greedy_text(engine, ids, 24)
    assert logged(stack, "decode-1", request_id, "the prefill worker's lease lapsed")
    wait_for_blocks_back(stack)
