"""Cross-worker prefix reuse on a real Stack (real SmolLM2, NATS, Redis, kv-index, NIXL over UCX):
decode worker B fetches a prompt's cached prefix from decode worker A instead of recomputing it,
and gives the same greedy text as the in-process engine; a holder that dies mid-fetch costs only
the fetch (B computes the prefix, same text) and B's blocks held for it come back.

The requests go to the workers' own subjects over NATS (a worker chosen by the test, as a custom
client would), and admission is asked directly which worker it would name as the prefix's source.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from shared.bus import Bus
from shared.kvcache.hashing import hash_blocks
from shared.protocol import GenerateRequest, KvFetchRequest, KvSource, SamplingParams, Subjects
from stack_helpers import (cluster_status, greedy_text, reference_engine_fixture, require_nixl, running_stack,
                           stack_spec, wait_for)

require_nixl()

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 2048
ENGINE = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "160MiB", "device": "cpu", "num_warmup_requests": 1}
DOC = ("A steam engine boils water in a closed boiler; the steam pushes a piston back and forth, and a "
       "crank turns that motion into the rotation of a wheel. ") * 12  # ~380 tokens
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    spec = stack_spec(tmp_path_factory.mktemp("fetch"), "f", nats_server, redis_server, num_decode=2, model=MODEL,
                      registry_ttl_s=3.0, decode_flags={**ENGINE, "drain_timeout_s": 10})
    with running_stack(spec, ready_timeout_s=240) as s:
        yield s


engine = reference_engine_fixture(MODEL, MAX_MODEL_LEN, 160 << 20)


def request(engine, text: str, **update) -> GenerateRequest:
    ids = engine.tokenizer.encode(text)
    return GenerateRequest(request_id=f"t-{uuid.uuid4().hex[:12]}", model=MODEL, prompt_token_ids=ids,
                           block_hashes=hash_blocks(ids, 16, engine.kv_namespace),
                           sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                           **update)


async def generate(stack, worker_id: str, req: GenerateRequest) -> tuple[list[int], int]:
    """(token ids, prompt tokens served from the worker's cache) from the worker's own subject."""
    bus = await Bus.connect(stack.spec.nats_url, "test-client")
    try:
        ids, cached = [], 0
        async for chunk in bus.stream(Subjects(stack.spec.namespace).decode_generate(worker_id), req,
                                      first_timeout_s=120, idle_timeout_s=60):
            ids += chunk.token_ids
            cached = max(cached, chunk.num_cached_tokens)
        return ids, cached
    finally:
        await bus.close()


async def ask_admission(stack, req: GenerateRequest):
    bus = await Bus.connect(stack.spec.nats_url, "test-admission-client")
    try:
        return await bus.request(Subjects(stack.spec.namespace).admission_submit(), req, timeout_s=10)
    finally:
        await bus.close()


def loads(stack) -> dict[str, dict]:
    return {w["info"]["worker_id"]: w["load"] for w in cluster_status(stack)["workers"] if w.get("load")}


def test_a_worker_fetches_the_prefix_another_holds_and_gives_the_same_text(stack, engine):
    holder, taker = stack.worker_id("decode-1"), stack.worker_id("decode-2")
    first = request(engine, DOC + "Question: what turns the wheel?")
    asyncio.run(generate(stack, holder, first))
    second = request(engine, DOC + "Question: where is the water boiled?")
    num_doc_blocks = len(engine.tokenizer.encode(DOC)) // 16

    # admission, told not to use the holder, names it as the source of the prefix
    probe = second.model_copy(update={"exclude_workers": [holder]})
    decision = wait_for(lambda: (d := asyncio.run(ask_admission(stack, probe))).kv_source and d, 20,
                        "admission to learn from kv-index that the holder has the prefix")
    assert decision.worker_id == taker
    assert decision.kv_source.worker_id == holder and decision.kv_source.num_blocks >= num_doc_blocks - 1

    ids, cached = asyncio.run(generate(stack, taker, second.model_copy(update={"kv_source": decision.kv_source})))
    assert engine.tokenizer.decode(ids) == greedy_text(engine, second.prompt_token_ids, MAX_TOKENS, ignore_eos=True)
    assert cached >= (num_doc_blocks - 1) * 16  # the fetched blocks were prefix-cache hits
    assert any(f"{second.request_id}: fetched" in line and f"from {holder}" in line for line in stack.lines)
    fetched = wait_for(lambda: (l := loads(stack))[taker]["kv_fetch"]["num_fetches"] == 1 and l, 15,
                       "the taker's load report counting the fetch")
    assert fetched[taker]["kv_fetch"]["num_blocks_fetched"] >= num_doc_blocks - 1
    assert fetched[taker]["kv_fetch"]["num_failed"] == 0
    assert fetched[holder]["kv_fetch"]["num_lent"] == 1


def test_a_holder_that_dies_mid_fetch_costs_only_the_fetch(stack, engine):
    """A fake holder takes the ask and vanishes without answering: the request computes its prefix,
    gives the reference text, and the blocks held for the fetch come back once no write can land."""
    taker = stack.worker_id("decode-2")
    req = request(engine, "Tell me about clocks. " + DOC.replace("steam", "water"),
                  kv_source=KvSource(worker_id="ghost", num_blocks=20))
    asked: list[KvFetchRequest] = []

    async def run() -> list[int]:
        ghost = await Bus.connect(stack.spec.nats_url, "ghost")
        died = asyncio.Event()

        async def take_and_die(ask: KvFetchRequest):
            asked.append(ask)
            died.set()
            await asyncio.sleep(3600)  # never answers; the connection closes below

        await ghost.serve(Subjects(stack.spec.namespace).kv_fetch("ghost"), take_and_die)
        await ghost.flush()
        task = asyncio.create_task(generate(stack, taker, req))
        await asyncio.wait_for(died.wait(), 60)
        await ghost.close()
        return (await task)[0]

    ids = asyncio.run(run())
    assert engine.tokenizer.decode(ids) == greedy_text(engine, req.prompt_token_ids, MAX_TOKENS, ignore_eos=True)
    assert len(asked) == 1 and asked[0].decode_worker_id == taker and len(asked[0].block_ids) >= 19
    after = wait_for(lambda: (l := loads(stack))[taker]["kv_fetch"]["num_failed"] == 1
                     and l[taker]["num_blocks_used"] == 0 and l, 30,
                     "the taker to count the failed fetch and give its blocks back")
    assert after[taker]["kv_fetch"]["num_fetches"] == 1  # only the first test's
