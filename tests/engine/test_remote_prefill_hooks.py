"""Engine hooks for disaggregated prefill, on the real model: a prefill engine computes a prompt's
KV and holds it; a decode engine reserves blocks, receives only the uncached blocks (copied here in
process, as NIXL will copy them between workers) and decodes exactly what the aggregated path does."""

import pytest

from shared.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


def run(engine):
    tokens = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


def prefill_remotely(prefill, decode, rid, prompt, *, write=True):
    """Prefill on one engine, move the uncached blocks into the other's reserved blocks."""
    slot = decode.reserve_remote_prefill(rid, prompt, GREEDY)
    assert slot is not None
    prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), keep_kv=True)
    run(prefill)
    src = prefill.request_block_ids(rid)
    assert len(src) == len(slot.block_ids)  # held after finishing, until released
    first = slot.num_cached_tokens // decode.block_size
    if write:
        decode.write_kv_blocks(slot.uncached_block_ids, prefill.read_kv_blocks(src[first:]))
    assert prefill.release_kv(rid)
    decode.finish_remote_prefill(rid, kv_written=True)
    return slot


def test_remote_prefill_decodes_like_the_aggregated_path(make_engine, chat_prompts):
    prompts = [chat_prompts[3], chat_prompts[0]]
    reference = make_engine().generate(prompts, GREEDY)
    prefill, decode = make_engine(), make_engine()
    slots = [prefill_remotely(prefill, decode, f"r{i}", p) for i, p in enumerate(prompts)]
    assert slots[0].num_cached_tokens == 0
    # the second prompt shares the system prompt with the first: those blocks are not moved
    assert slots[1].num_cached_tokens >= 16 and len(slots[1].uncached_block_ids) < len(slots[1].block_ids)
    out = run(decode)
    assert [out["r0"], out["r1"]] == reference
    for engine in (prefill, decode):
        assert engine.kv.pool.num_free_blocks == engine.num_blocks
        engine.kv.check_integrity()


def test_the_moved_kv_is_what_the_decode_uses(make_engine, chat_prompts):
    """Negative control: marking the KV written without writing it changes the output."""
    prompt = chat_prompts[3]
    reference = make_engine().generate([prompt], GREEDY)[0]
    prefill, decode = make_engine(), make_engine()
    prefill_remotely(prefill, decode, "x", prompt, write=False)
    assert run(decode)["x"] != reference


def test_fallback_prefills_locally(make_engine, chat_prompts):
    prompt = chat_prompts[2]
    reference = make_engine().generate([prompt], GREEDY)[0]
    decode = make_engine()
    assert decode.reserve_remote_prefill("f", prompt, GREEDY) is not None
    assert not decode.has_unfinished_requests()  # nothing to step while the KV is awaited
    decode.finish_remote_prefill("f", kv_written=False)
    assert run(decode)["f"] == reference


def test_abort_while_awaiting_kv_keeps_blocks_until_the_transfer_ends(make_engine, chat_prompts):
    decode = make_engine()
    slot = decode.reserve_remote_prefill("a", chat_prompts[3], GREEDY)
    out = decode.abort_request("a")
    assert out.finish_reason == "abort"
    # a prefill worker may still be writing into these blocks: none may be reused yet
    assert decode.kv.pool.num_used_blocks == len(slot.block_ids)
    decode.finish_remote_prefill("a", kv_written=True)
    assert decode.kv.pool.num_free_blocks == decode.num_blocks
    decode.kv.check_integrity()


def test_reservation_fails_cleanly_when_the_pool_is_full(make_engine, chat_prompts):
    per_block = 30 * 2 * 3 * 64 * 4 * 16
    decode = make_engine(kv_cache_memory=per_block * 7)  # 112 tokens: too small for the long prompt
    with pytest.raises(ValueError, match="KV cache"):
        decode.reserve_remote_prefill("big", chat_prompts[3], GREEDY)
    assert decode.reserve_remote_prefill("s1", chat_prompts[0], GREEDY) is not None
    assert decode.reserve_remote_prefill("s2", chat_prompts[1], GREEDY) is not None
    assert decode.reserve_remote_prefill("s3", chat_prompts[4], GREEDY) is None  # no room now
    assert decode.kv.pool.num_used_blocks == 5  # 3 + 2 blocks reserved, the third needed 3 more


async def test_async_engine_reserve_write_finish_stream(make_engine, chat_prompts):
    from shared.engine import AsyncEngine

    prompt = chat_prompts[3]
    reference = make_engine().generate([prompt], GREEDY)[0]
    prefill = make_engine()
    prefill.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0), keep_kv=True)
    run(prefill)
    slab = prefill.read_kv_blocks(prefill.request_block_ids("p"))
    decode = AsyncEngine(make_engine())
    try:
        slot = await decode.reserve_remote_prefill("d", prompt, GREEDY)
        assert slot is not None and slot.num_cached_tokens == 0
        assert await decode.call(lambda e: e.stats().num_remote_pending) == 1
        await decode.call(lambda e: e.write_kv_blocks(slot.block_ids, slab))
        decode.finish_remote_prefill("d", kv_written=True)
        got = [t async for o in decode.stream("d") for t in o.new_token_ids]
        assert got == reference
        # a late or repeated notification for a finished request is ignored
        decode.finish_remote_prefill("d", kv_written=True)
        assert await decode.call(lambda e: e.kv.pool.num_used_blocks) == 0
    finally:
        decode.shutdown()
