"""Engine hooks for disaggregated prefill, on the real model: a prefill engine computes a prompt's
KV and holds it; a decode engine reserves blocks, receives only the uncached blocks (copied here in
process, as NIXL will copy them between workers) and decodes exactly what the aggregated path does."""

import pytest
import torch

from shared.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


def run(engine):
    tokens = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


def read_blocks(engine, block_ids):
    return engine.kv_cache[torch.tensor(block_ids, dtype=torch.long)]  # [n, L, 2, bs, Hkv, D], a copy


def write_blocks(engine, block_ids, slab):
    """What a NIXL write does between workers: ``slab`` lands in ``block_ids`` of ``engine``'s pool."""
    assert slab.shape == (len(block_ids), *engine.kv_cache.shape[1:]), (slab.shape, len(block_ids))
    engine.kv_cache[torch.tensor(block_ids, dtype=torch.long)] = slab


def prefill_remotely(prefill, decode, rid, prompt, *, write=True):
    """Prefill on one engine, move the uncached blocks into the other's reserved blocks."""
    slot = decode.reservations.reserve_remote_prefill(rid, prompt, GREEDY)
    assert slot is not None
    prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), keep_kv=True)
    run(prefill)
    src = prefill.reservations.request_block_ids(rid)
    assert len(src) == len(slot.block_ids)  # held after finishing, until released
    first = slot.num_cached_tokens // decode.block_size
    if write:
        write_blocks(decode, slot.uncached_block_ids, read_blocks(prefill, src[first:]))
    assert prefill.reservations.release_kv(rid)
    decode.reservations.finish_remote_prefill(rid, kv_written=True)
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
    assert decode.reservations.reserve_remote_prefill("f", prompt, GREEDY) is not None
    assert not decode.has_unfinished_requests()  # nothing to step while the KV is awaited
    decode.reservations.finish_remote_prefill("f", kv_written=False)
    assert run(decode)["f"] == reference


def test_abort_while_awaiting_kv_keeps_blocks_until_the_transfer_ends(make_engine, chat_prompts):
    decode = make_engine()
    slot = decode.reservations.reserve_remote_prefill("a", chat_prompts[3], GREEDY)
    out = decode.abort_request("a")
    assert out.finish_reason == "abort"
    # a prefill worker may still be writing into these blocks: none may be reused yet
    assert decode.kv.pool.num_used_blocks == len(slot.block_ids)
    decode.reservations.finish_remote_prefill("a", kv_written=True)
    assert decode.kv.pool.num_free_blocks == decode.num_blocks
    decode.kv.check_integrity()


def test_reservation_fails_cleanly_when_the_pool_is_full(make_engine, chat_prompts):
    per_block = 30 * 2 * 3 * 64 * 4 * 16
    decode = make_engine(kv_cache_memory=per_block * 7)  # 112 tokens: too small for the long prompt
    with pytest.raises(ValueError, match="KV cache"):
        decode.reservations.reserve_remote_prefill("big", chat_prompts[3], GREEDY)
    assert decode.reservations.reserve_remote_prefill("s1", chat_prompts[0], GREEDY) is not None
    assert decode.reservations.reserve_remote_prefill("s2", chat_prompts[1], GREEDY) is not None
    assert decode.reservations.reserve_remote_prefill("s3", chat_prompts[4], GREEDY) is None  # no room now
    assert decode.kv.pool.num_used_blocks == 5  # 3 + 2 blocks reserved, the third needed 3 more


async def test_async_engine_reserve_write_finish_stream(make_engine, chat_prompts):
    from shared.engine import AsyncEngine

    prompt = chat_prompts[3]
    reference = make_engine().generate([prompt], GREEDY)[0]
    prefill = make_engine()
    prefill.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0), keep_kv=True)
    run(prefill)
    slab = read_blocks(prefill, prefill.reservations.request_block_ids("p"))
    decode = AsyncEngine(make_engine())
    try:
        slot = await decode.reserve_remote_prefill("d", prompt, GREEDY)
        assert slot is not None and slot.num_cached_tokens == 0
        assert await decode.call(lambda e: e.stats().num_remote_pending) == 1
        await decode.call(lambda e: write_blocks(e, slot.block_ids, slab))
        decode.finish_remote_prefill("d", kv_written=True)
        got = [t async for o in decode.stream("d") for t in o.new_token_ids]
        assert got == reference
        # a late or repeated notification for a finished request is ignored
        decode.finish_remote_prefill("d", kv_written=True)
        assert await decode.call(lambda e: e.kv.pool.num_used_blocks) == 0
    finally:
        decode.shutdown()


# -- only full blocks move; the partial tail is recomputed on the decode side ------------------------

def prefill_full_blocks_only(prefill, decode, rid, prompt):
    """Like ``prefill_remotely``, but write only ``slot.transfer_block_ids`` and fill the partial
    tail block with garbage first: the decode side must recompute it."""
    bs = decode.block_size
    slot = decode.reservations.reserve_remote_prefill(rid, prompt, GREEDY)
    assert slot is not None and slot.num_prompt_tokens == len(prompt)
    first, num_full = slot.num_cached_tokens // bs, len(prompt) // bs
    assert slot.transfer_block_ids == slot.block_ids[first:num_full]
    tail = slot.block_ids[num_full:]
    assert len(tail) == (1 if len(prompt) % bs else 0)
    if tail:  # large finite garbage: not read, or the output would change
        garbage = torch.randn(read_blocks(decode, tail).shape, generator=torch.Generator().manual_seed(0)) * 50
        write_blocks(decode, tail, garbage.to(decode.kv_cache.dtype))
    prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), keep_kv=True)
    run(prefill)
    src = prefill.reservations.request_block_ids(rid)
    if slot.transfer_block_ids:
        write_blocks(decode, slot.transfer_block_ids, read_blocks(prefill, src[first:num_full]))
    assert prefill.reservations.release_kv(rid)
    decode.reservations.finish_remote_prefill(rid, kv_written=True)
    return slot


def test_only_full_blocks_need_to_be_written(make_engine, chat_prompts):
    prompts = [chat_prompts[3], chat_prompts[0]]  # 175 and 37 tokens: both end in a partial block
    assert all(len(p) % 16 for p in prompts)
    reference = make_engine().generate(prompts, GREEDY)
    prefill, decode = make_engine(), make_engine()
    slots = [prefill_full_blocks_only(prefill, decode, f"r{i}", p) for i, p in enumerate(prompts)]
    assert slots[0].num_cached_tokens == 0 and len(slots[0].transfer_block_ids) == 175 // 16
    assert slots[1].num_cached_tokens >= 16  # the shared system prompt, from r0's received blocks
    out = run(decode)
    assert [out["r0"], out["r1"]] == reference
    for engine in (prefill, decode):
        assert engine.kv.pool.num_free_blocks == engine.num_blocks
        engine.kv.check_integrity()


@pytest.mark.parametrize("length", [160, 10], ids=["block-multiple", "under-one-block"])
def test_full_block_transfer_at_the_edges(make_engine, chat_prompts, length):
    """A block-multiple prompt moves every block (its last token is recomputed for the logits); a
    prompt shorter than a block moves nothing and prefills wholly on the decode side."""
    prompt = chat_prompts[3][:length]
    reference = make_engine().generate([prompt], GREEDY)[0]
    prefill, decode = make_engine(), make_engine()
    slot = prefill_full_blocks_only(prefill, decode, "e", prompt)
    assert len(slot.transfer_block_ids) == length // 16
    assert run(decode)["e"] == reference
    assert decode.kv.pool.num_free_blocks == decode.num_blocks
    decode.kv.check_integrity()


# -- decide: asked first, with the local cache state; no means nothing changes -------------------------

def test_decide_false_reserves_nothing_and_sees_the_cached_prefix(make_engine, chat_prompts):
    decode = make_engine()
    seen = []

    def refuse(num_cached):
        seen.append(num_cached)
        return False

    assert decode.reservations.reserve_remote_prefill("n", chat_prompts[3], GREEDY, decide=refuse) is None
    assert seen == [0]
    assert decode.kv.pool.num_used_blocks == 0 and decode.stats().num_remote_pending == 0

    decode.generate([chat_prompts[3]], GREEDY)  # leaves the prompt's full blocks in the prefix cache
    pool = decode.kv.pool
    before = (pool.num_used_blocks, pool.num_cached_blocks, pool.eviction_order())
    assert decode.reservations.reserve_remote_prefill("n", chat_prompts[3], GREEDY, decide=refuse) is None
    assert seen[-1] == 175 // 16 * 16  # every full block of the same prompt is cached
    assert decode.reservations.reserve_remote_prefill("n", chat_prompts[0], GREEDY, decide=refuse) is None
    assert seen[-1] >= 16 and seen[-1] % 16 == 0  # the shared system prompt
    assert (pool.num_used_blocks, pool.num_cached_blocks, pool.eviction_order()) == before
    assert decode.stats().num_remote_pending == 0 and not decode.has_unfinished_requests()
    decode.kv.check_integrity()

    # nothing was registered: the id is free, and a yes reserves with the count decide saw
    accepted = []
    slot = decode.reservations.reserve_remote_prefill("n", chat_prompts[0], GREEDY,
                                         decide=lambda n: accepted.append(n) or True)
    assert slot is not None and accepted == [seen[-1]] == [slot.num_cached_tokens]


# -- keep_kv on the decode side: reserved blocks are held past the request's end ----------------------

def test_keep_kv_holds_an_aborted_reservation_until_released(make_engine, chat_prompts):
    decode = make_engine()
    slot = decode.reservations.reserve_remote_prefill("k", chat_prompts[3], GREEDY, keep_kv=True)
    assert decode.abort_request("k").finish_reason == "abort"
    assert decode.kv.pool.num_used_blocks == len(slot.block_ids)
    decode.reservations.finish_remote_prefill("k", kv_written=True)
    # a late write may still come until the owner releases: the blocks stay held
    assert decode.kv.pool.num_used_blocks == len(slot.block_ids)
    assert decode.reservations.request_block_ids("k") == slot.block_ids
    assert decode.stats().num_held == 1 and decode.stats().num_remote_pending == 0
    decode.kv.check_integrity()
    with pytest.raises(ValueError, match="duplicate"):
        decode.reservations.reserve_remote_prefill("k", chat_prompts[0], GREEDY)
    with pytest.raises(ValueError, match="duplicate"):
        decode.add_request("k", chat_prompts[0], GREEDY)
    assert decode.reservations.release_kv("k")
    assert not decode.reservations.release_kv("k")
    assert decode.kv.pool.num_free_blocks == decode.num_blocks and decode.stats().num_held == 0
    decode.kv.check_integrity()
    assert decode.reservations.reserve_remote_prefill("k", chat_prompts[0], GREEDY) is not None  # the id is free again


def test_keep_kv_holds_a_finished_remote_request_until_released(make_engine, chat_prompts):
    prompt = chat_prompts[3]
    reference = make_engine().generate([prompt], GREEDY)[0]
    prefill, decode = make_engine(), make_engine()
    slot = decode.reservations.reserve_remote_prefill("h", prompt, GREEDY, keep_kv=True)
    prefill.add_request("h", prompt, SamplingParams(max_tokens=1, temperature=0.0), keep_kv=True)
    run(prefill)
    first = slot.num_cached_tokens // decode.block_size
    src = prefill.reservations.request_block_ids("h")[first:len(prompt) // decode.block_size]
    write_blocks(decode, slot.transfer_block_ids, read_blocks(prefill, src))
    assert prefill.reservations.release_kv("h")
    decode.reservations.finish_remote_prefill("h", kv_written=True)
    assert run(decode)["h"] == reference
    held = decode.reservations.request_block_ids("h")
    assert held[:len(slot.block_ids)] == slot.block_ids  # the reserved blocks, plus the generated tokens'
    assert decode.kv.pool.num_used_blocks == len(held) and decode.stats().num_held == 1
    assert decode.abort_request("h") is None  # finished: nothing to abort, still held
    assert decode.kv.pool.num_used_blocks == len(held)
    with pytest.raises(ValueError, match="duplicate"):
        decode.reservations.reserve_remote_prefill("h", prompt, GREEDY, keep_kv=True)
    assert decode.reservations.release_kv("h")
    assert decode.kv.pool.num_free_blocks == decode.num_blocks
    decode.kv.check_integrity()


def test_an_aborted_reservation_keeps_its_id_until_the_transfer_ends(make_engine, chat_prompts):
    """Its blocks may still be written: the id may not be reserved or added again meanwhile."""
    decode = make_engine()
    decode.reservations.reserve_remote_prefill("r", chat_prompts[3], GREEDY)
    decode.abort_request("r")
    with pytest.raises(ValueError, match="duplicate"):
        decode.reservations.reserve_remote_prefill("r", chat_prompts[3], GREEDY)
    with pytest.raises(ValueError, match="duplicate"):
        decode.add_request("r", chat_prompts[3], GREEDY)
    decode.reservations.finish_remote_prefill("r", kv_written=False)
    assert decode.kv.pool.num_free_blocks == decode.num_blocks
    assert decode.reservations.reserve_remote_prefill("r", chat_prompts[3], GREEDY) is not None


def test_keep_kv_holds_a_fallen_back_request_until_released(make_engine, chat_prompts):
    """No KV came (the decode worker's window closed): the request prefills locally and, finished,
    holds its blocks like a remote one until the owner releases them."""
    prompt = chat_prompts[2]
    reference = make_engine().generate([prompt], GREEDY)[0]
    decode = make_engine()
    slot = decode.reservations.reserve_remote_prefill("t", prompt, GREEDY, keep_kv=True)
    decode.reservations.finish_remote_prefill("t", kv_written=False)
    assert run(decode)["t"] == reference
    stats = decode.stats()
    assert stats.num_held == 1 and stats.num_remote_pending == 0
    assert stats.num_blocks_used == len(decode.reservations.request_block_ids("t")) >= len(slot.block_ids)
    assert decode.reservations.release_kv("t")
    stats = decode.stats()
    assert stats.num_held == 0 and stats.num_blocks_used == 0
    decode.kv.check_integrity()
