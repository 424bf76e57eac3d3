"""A different parallelism per phase in a real stack (SmolLM2, float32): a prefill worker at TP=3
beside a decode worker at TP=1 and one at TP=3, every prompt prefilled remotely
(``--max-local-prefill-tokens 0``), so the prefill group's KV is re-laid out in transit into a
single process (its ranks gather their heads and split the layers) and written rank to rank into
the group of its own shape; and a prefix lent between the two decode workers both ways (one
process writing into three ranks, one head each, and three ranks into one). Greedy text equal to
the in-process aggregated path, the bytes each decode worker was told of equal to the KV of the
prompts' full blocks. The pairs the stack leaves out (pipeline stages, nested heads) are checked
bit for bit in tests/engine/test_kv_relayout.py."""

from __future__ import annotations

import asyncio
import json
import platform
from urllib.request import urlopen

import pytest

from shared.protocol import KvSource
from stack_helpers import greedy_text, reference_engine_fixture, running_stack, stack_spec, wait_for

if platform.system() != "Linux":
    pytest.skip("NIXL (nixl-cu12) is a dependency on Linux only", allow_module_level=True)

from test_peer_fetch import generate, request  # noqa: E402 — NIXL checked there too

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 2048
BLOCK = 16
ENGINE = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "96MiB", "device": "cpu", "num_warmup_requests": 1}
PROMPTS = ["In one short paragraph, explain to a curious child why the sky looks blue at noon:",
           "Tandem moves the KV cache of long prompts from prefill workers to decode workers. " * 6
           + "Say in one sentence what moves:"]
DOC = ("A steam engine boils water in a closed boiler; the steam pushes a piston back and forth, and a "
       "crank turns that motion into the rotation of a wheel. ") * 12  # ~380 tokens


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    spec = stack_spec(tmp_path_factory.mktemp("phases"), "ph", nats_server, redis_server, num_decode=2, num_prefill=1,
                      model=MODEL,
                      decode_flags={**ENGINE, "max_local_prefill_tokens": 0, "remote_prefill_timeout_s": 60,
                                    "kv_write_timeout_s": 20, "prefill_lease_s": 40},
                      prefill_flags={**ENGINE, "tensor_parallel_size": 3},
                      worker_flags={"decode-2": {"tensor_parallel_size": 3}})
    with running_stack(spec, ready_timeout_s=300) as s:
        yield s


engine = reference_engine_fixture(MODEL, MAX_MODEL_LEN, 160 << 20)


def worker_load(stack, worker_id: str) -> dict | None:
    with urlopen(stack.base_url + "/status", timeout=10) as resp:
        view = json.load(resp)
    return next((w["load"] for w in view["workers"] if w["info"]["worker_id"] == worker_id and w["load"]), None)


@pytest.mark.parametrize("decode", ["decode-1", "decode-2"], ids=["prefill-tp3-to-decode-tp1",
                                                                 "prefill-tp3-to-decode-tp3"])
def test_kv_re_laid_out_between_phases_gives_the_aggregated_text(stack, engine, decode):
    """(The first takes over a minute: the stack of seven rank processes starts on two cores.)"""
    worker = stack.worker_id(decode)
    before = wait_for(lambda: worker_load(stack, worker), 60, f"{decode}'s load report")
    received = before["kv_bytes_received"]
    for i, prompt in enumerate(PROMPTS):
        req = request(engine, prompt)
        ids, cached = asyncio.run(generate(stack, worker, req))
        assert engine.tokenizer.decode(ids) == greedy_text(engine, req.prompt_token_ids, 16, ignore_eos=True)
        # the whole model's KV of the uncached full blocks, whatever the two shapes
        n = len(req.prompt_token_ids)
        received += (n // BLOCK - cached // BLOCK) * engine.kv_spec.bytes_per_block
        load = wait_for(lambda: (l := worker_load(stack, worker))
                        and l["num_remote_prefills"] >= before["num_remote_prefills"] + i + 1 and l,
                        60, f"the remote prefill in {decode}'s load report")
        assert load["kv_bytes_received"] == received
    assert load["num_local_prefills"] == before["num_local_prefills"]
    assert load["num_prefill_fallbacks"] == before["num_prefill_fallbacks"]


def test_a_prefix_is_fetched_between_decode_workers_of_different_shapes(stack, engine):
    """The TP=3 decode worker lends its cached prefix to the TP=1 one, and the other way round:
    the taker's text equal to the in-process greedy text, its prompt served from the fetched
    blocks."""
    group, single = stack.worker_id("decode-2"), stack.worker_id("decode-1")
    num_doc_blocks = len(engine.tokenizer.encode(DOC)) // BLOCK
    for holder, taker, topic in ((group, single, "what turns the wheel?"), (single, group, "what is boiled?")):
        doc = f"{topic} " + DOC  # a prefix of its own for each direction
        asyncio.run(generate(stack, holder, request(engine, doc + "Question: " + topic)))
        second = request(engine, doc + "Question: where does the steam go?")
        source = KvSource(worker_id=holder, num_blocks=num_doc_blocks - 1)
        ids, cached = asyncio.run(generate(stack, taker, second.model_copy(update={"kv_source": source})))
        assert engine.tokenizer.decode(ids) == greedy_text(engine, second.prompt_token_ids, 16, ignore_eos=True)
        assert cached >= (num_doc_blocks - 1) * BLOCK, (holder, taker)
        assert any(f"{second.request_id}: fetched" in line and f"from {holder}" in line for line in stack.lines)
