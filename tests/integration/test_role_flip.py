"""A decode worker flips to prefill and back in the same process, over its control subject, while
serving: two decode workers on the real SmolLM2, real nats-server, redis-server and NIXL. Requests in
flight on the flipping worker finish there with the same greedy text as an in-process reference;
as a prefill worker it prefills the other decode worker's prompts and writes their KV over NIXL; it
flips back with a prefill in flight; the model is loaded once.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from shared.protocol import ControlRequest, Subjects
from stack_helpers import cluster_status, running_stack, stack_spec, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 2048
ENGINE = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "160MiB", "device": "cpu", "num_warmup_requests": 1}
PROMPTS = ["The three primary colours are", "Write a haiku about a quiet harbour:",
           "A short history of the bicycle begins in", "def fibonacci(n):",
           "The capital of Australia is", "Explain photosynthesis to a child:"]
MAX_TOKENS = 48
LONG_DOC = ("A prefill worker computes the keys and values of a long prompt and writes them into the "
            "blocks a decode worker reserved for it. ") * 30


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    spec = stack_spec(
        tmp_path_factory.mktemp("flip"), "f", nats_server, redis_server, num_decode=2, model=MODEL, registry_ttl_s=3.0,
        # every uncached prompt goes remote whenever a prefill worker is listed
        decode_flags={**ENGINE, "max_local_prefill_tokens": 0, "remote_prefill_timeout_s": 60, "drain_timeout_s": 60})
    with running_stack(spec, ready_timeout_s=300) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def engine():
    from shared.engine import AsyncEngine, EngineConfig

    e = AsyncEngine.start(EngineConfig(model=MODEL, device="cpu", max_model_len=MAX_MODEL_LEN,
                                       kv_cache_memory=160 << 20, dtype="float32"))
    yield e
    e.shutdown()


def greedy(engine, prompt: str, max_tokens: int) -> str:
    from shared.engine import SamplingParams

    async def run():
        ids = []
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        async for out in engine.generate(f"ref-{uuid.uuid4().hex}", engine.tokenizer.encode(prompt), params):
            ids += out.new_token_ids
        return engine.tokenizer.decode(ids)

    return asyncio.run(run())


def streamed(client, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in stream)


def control(stack, worker_id: str, **kw):
    from shared.bus import Bus

    async def send():
        bus = await Bus.connect(stack.nats_url, "test-flip")
        try:
            return await bus.request(Subjects(stack.spec.namespace).control(worker_id), ControlRequest(**kw),
                                     timeout_s=10)
        finally:
            await bus.close()

    return asyncio.run(send())


def entry(stack, worker_id: str) -> dict:
    """The worker's registry entry and latest load report, as /status shows them ({} if not listed)."""
    return next((w for w in cluster_status(stack)["workers"] if w["info"]["worker_id"] == worker_id), {})


def serving_as(stack, worker_id: str, role: str) -> dict | None:
    e = entry(stack, worker_id)
    return e if e and e["info"]["role"] == role and e["info"]["state"] == "ready" else None


def test_a_decode_worker_flips_to_prefill_and_back_without_losing_a_request(stack, client, engine, capsys):
    """Near or over a minute because each flip drains the worker's running requests and waits for it
    to serve again in its new role, twice, under load."""
    flipper, other = (f"{stack.spec.namespace}-decode-{i}" for i in (2, 1))
    pid = entry(stack, flipper)["info"]["pid"]
    pool = ThreadPoolExecutor(len(PROMPTS) + 2)
    in_flight = [pool.submit(streamed, client, p) for p in PROMPTS]
    wait_for(lambda: control(stack, flipper, action="status").num_in_flight > 0, 120,
             f"requests in flight on {flipper}")

    result = control(stack, flipper, action="flip", role="prefill")
    assert (result.state, result.role, result.flipping_to) == ("draining", "decode", "prefill")
    assert result.num_in_flight > 0  # the flip has requests of its own to finish
    during = [pool.submit(streamed, client, p) for p in PROMPTS[:2]]  # admission sends these elsewhere
    for prompt, future in zip(PROMPTS + PROMPTS[:2], in_flight + during):
        assert future.result(timeout=300) == greedy(engine, prompt, MAX_TOKENS), prompt

    wait_for(lambda: serving_as(stack, flipper, "prefill"), 120, f"{flipper} listed as a ready prefill worker")
    assert entry(stack, flipper)["info"]["pid"] == pid
    # as a prefill worker it prefills the remaining decode worker's prompts and writes their KV over NIXL
    prompt = LONG_DOC + "In one sentence, what does a prefill worker do?"
    assert streamed(client, prompt, 16) == greedy(engine, prompt, 16)
    wait_for(lambda: (e := entry(stack, flipper)) and e["load"] and e["load"]["role"] == "prefill"
             and e["load"]["num_remote_prefills"] >= 1, 30, f"a KV write by {flipper}")

    # back to decode, with a prefill in flight on it
    long_prompt = LONG_DOC * 2 + "Summarise the text above:"
    thread_result: dict = {}
    thread = threading.Thread(target=lambda: thread_result.update(text=streamed(client, long_prompt, 16)))
    thread.start()
    wait_for(lambda: any(l.startswith("decode-2|") and "prefilling" in l for l in stack.lines), 120,
             f"{flipper} prefilling the long prompt")
    from services.cli import main

    assert main(["control", flipper, "--flip", "decode", "--nats-url", stack.nats_url,
                 "--namespace", stack.spec.namespace]) == 0
    assert json.loads(capsys.readouterr().out)["flipping_to"] == "decode"
    thread.join(300)
    assert thread_result["text"] == greedy(engine, long_prompt, 16)
    wait_for(lambda: serving_as(stack, flipper, "decode"), 120, f"{flipper} listed as a ready decode worker")
    assert entry(stack, flipper)["info"]["pid"] == pid
    assert sum(l.startswith("decode-2|") and f"loading {MODEL}" in l for l in stack.lines) == 1, "the model was reloaded"

    # it serves decode again: with the other decode worker gone, it takes every request
    control(stack, other, action="drain")
    wait_for(lambda: not entry(stack, other), 120, f"{other} to leave")
    prompt = "After the flip, the worker that was a prefill worker decodes:"
    assert streamed(client, prompt) == greedy(engine, prompt, MAX_TOKENS)
    load = wait_for(lambda: (e := entry(stack, flipper)) and e["load"] and e["load"]["role"] == "decode"
                    and e["load"]["num_requests_total"] >= 1 and e["load"], 30, f"a request served by {flipper}")
    assert load["num_requests_aborted"] == 0
