"""A different parallelism per phase in a real stack: SmolLM2 (float32), every prompt prefilled
remotely (``--max-local-prefill-tokens 0``), the KV re-laid out in transit between a prefill worker
and a decode worker of different shapes: prefill TP=3 into decode TP=1 (the prefill ranks gather
their heads and split the layers), and prefill PP=2 into decode TP=3 (each stage writes its layers
into every decode rank, one head each). Greedy text equal to the in-process aggregated path, and
the bytes the decode worker was told of equal to the KV of the prompt's full blocks."""

from __future__ import annotations

import json
import platform
import time
import uuid
from urllib.request import urlopen

import openai
import pytest

from shared.stack.stack import StackSpec
from stack_helpers import greedy_text, reference_engine, running_stack

if platform.system() != "Linux":
    pytest.skip("NIXL (nixl-cu12) is a dependency on Linux only", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 1024
BLOCK = 16
ENGINE = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "64MiB", "device": "cpu", "num_warmup_requests": 1}
PROMPTS = ["In one short paragraph, explain to a curious child why the sky looks blue at noon:",
           "Tandem moves the KV cache of long prompts from prefill workers to decode workers. " * 6
           + "Say in one sentence what moves:"]
SHAPES = [({"tensor_parallel_size": 3}, {}), ({"pipeline_parallel_size": 2}, {"tensor_parallel_size": 3})]


@pytest.fixture(scope="module")
def engine():
    with reference_engine(MODEL, MAX_MODEL_LEN, 64 << 20) as e:
        yield e


def worker_load(stack, role: str) -> dict | None:
    with urlopen(stack.base_url + "/status", timeout=10) as resp:
        view = json.load(resp)
    loads = [w["load"] for w in view["workers"] if w["info"]["role"] == role and w["load"]]
    return loads[0] if loads else None


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@pytest.mark.parametrize("prefill_shape,decode_shape", SHAPES, ids=["prefill-tp3-to-decode-tp1",
                                                                    "prefill-pp2-to-decode-tp3"])
def test_kv_re_laid_out_between_phases_gives_the_aggregated_text(nats_server, redis_server, tmp_path_factory,
                                                                 engine, prefill_shape, decode_shape):
    """Takes over a minute each: a stack of four or five rank processes starting on two cores."""
    spec = StackSpec(
        state_dir=tmp_path_factory.mktemp("phases"), num_decode=1, num_prefill=1, model=MODEL, port=0,
        namespace=f"ph{uuid.uuid4().hex[:8]}", nats_url=nats_server.url, redis_url=redis_server.url,
        decode_flags={**ENGINE, **decode_shape, "max_local_prefill_tokens": 0, "remote_prefill_timeout_s": 60,
                      "kv_write_timeout_s": 20, "prefill_lease_s": 40},
        prefill_flags={**ENGINE, **prefill_shape})
    with running_stack(spec, ready_timeout_s=300) as stack:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        before = wait_for(lambda: worker_load(stack, "decode"), 60, "the decode worker's load report")
        received = before["kv_bytes_received"]
        for i, prompt in enumerate(PROMPTS):
            ids = engine.tokenizer.encode(prompt)
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
            assert reply.choices[0].text == greedy_text(engine, ids, 16), prompt[:40]
            cached = reply.usage.prompt_tokens_details.cached_tokens
            # the whole model's KV of the uncached full blocks, whatever the two shapes
            received += (len(ids) // BLOCK - cached // BLOCK) * engine.kv_spec.bytes_per_block
            load = wait_for(lambda: (l := worker_load(stack, "decode"))
                            and l["num_remote_prefills"] >= before["num_remote_prefills"] + i + 1 and l,
                            60, "the remote prefill in the decode load report")
            assert load["kv_bytes_received"] == received
        assert load["num_local_prefills"] == before["num_local_prefills"]
        assert load["num_prefill_fallbacks"] == before["num_prefill_fallbacks"]
        assert any("wrote" in line and "KV blocks into" in line for line in stack.lines if line.startswith("prefill-1|"))


DOC = ("A steam engine boils water in a closed boiler; the steam pushes a piston back and forth, and a "
       "crank turns that motion into the rotation of a wheel. ") * 12  # ~380 tokens


def test_a_prefix_is_fetched_between_decode_workers_of_different_shapes(nats_server, redis_server,
                                                                        tmp_path_factory, engine):
    """A TP=3 decode worker lends its cached prefix to a TP=1 one, and the other way round: the
    taker's text equal to the in-process greedy text, its prompt served from the fetched blocks.
    Takes over a minute: a stack of four rank processes starting on two cores."""
    import asyncio

    from test_peer_fetch import generate, request

    from shared.protocol import KvSource

    spec = StackSpec(state_dir=tmp_path_factory.mktemp("fetch-shapes"), num_decode=2, model=MODEL, port=0,
                     namespace=f"fs{uuid.uuid4().hex[:8]}", nats_url=nats_server.url, redis_url=redis_server.url,
                     decode_flags={**ENGINE, "kv_cache_memory": "160MiB", "max_model_len": 2048},
                     worker_flags={"decode-1": {"tensor_parallel_size": 3}})
    num_doc_blocks = len(engine.tokenizer.encode(DOC)) // BLOCK
    with running_stack(spec, ready_timeout_s=300) as stack:
        group, single = stack.worker_id("decode-1"), stack.worker_id("decode-2")
        for holder, taker, topic in ((group, single, "what turns the wheel?"), (single, group, "what is boiled?")):
            doc = f"{topic} " + DOC  # a prefix of its own for each direction
            asyncio.run(generate(stack, holder, request(engine, doc + "Question: " + topic)))
            second = request(engine, doc + "Question: where does the steam go?")
            source = KvSource(worker_id=holder, num_blocks=num_doc_blocks - 1)
            ids, cached = asyncio.run(generate(stack, taker, second.model_copy(update={"kv_source": source})))
            assert engine.tokenizer.decode(ids) == greedy_text(engine, second.prompt_token_ids, 16, ignore_eos=True)
            assert cached >= (num_doc_blocks - 1) * BLOCK, (holder, taker)
            assert any(f"{second.request_id}: fetched" in line and f"from {holder}" in line for line in stack.lines)
