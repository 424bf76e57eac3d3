import pytest

from shared.kvcache.block_pool import BlockPool
from shared.kvcache.events import BlockRemoved, BlockStored, ListSink, KvEventEmitter
from shared.kvcache.hashing import hash_blocks, make_namespace
from shared.kvcache.manager import KVCacheManager

NS = make_namespace("m")
BS = 4


def manager(num_blocks=8):
    sink = ListSink()
    return KVCacheManager(num_blocks, BS, events=KvEventEmitter([sink])), sink


def run_request(kv, rid, tokens):
    """Allocate for a prompt (reusing its cached prefix), mark everything computed."""
    hashes = hash_blocks(tokens, BS, NS)
    hits, num_hit = kv.find_cached_prefix(hashes, len(tokens))
    table = kv.allocate_slots(rid, len(tokens), hits)
    assert table is not None
    kv.cache_computed(rid, tokens, hashes, len(tokens))
    return table, num_hit


def test_allocate_free_returns_every_block():
    kv, _ = manager()
    t1, _ = run_request(kv, "a", list(range(10)))
    t2, _ = run_request(kv, "b", list(range(100, 110)))
    assert len(t1) == 3 and len(t2) == 3 and not set(t1) & set(t2)
    assert kv.num_free_blocks == 2
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_allocation_fails_cleanly_when_short():
    kv, _ = manager(4)
    assert kv.allocate_slots("a", 12) is not None
    before = kv.num_free_blocks
    assert kv.allocate_slots("b", 8) is None  # needs 2, has 1
    assert kv.num_free_blocks == before and kv.block_ids("b") == []
    kv.check_integrity()


def test_prefix_hit_shares_blocks_and_counts_references():
    kv, sink = manager()
    prompt = list(range(12))
    t1, hit1 = run_request(kv, "a", prompt + [50])
    t2, hit2 = run_request(kv, "b", prompt + [60, 61])
    assert hit1 == 0 and hit2 == 12
    assert t2[:3] == t1[:3] and t2[3] != t1[3]
    assert [kv.pool.blocks[i].ref_count for i in t1[:3]] == [2, 2, 2]
    stored = [e.event for e in sink.events if isinstance(e.event, BlockStored)]
    assert stored[0].parent_hash is None and stored[0].token_ids == tuple(prompt)
    assert [e.seq for e in sink.events] == list(range(1, len(sink.events) + 1))
    kv.check_integrity()


def test_fully_cached_prompt_still_computes_its_last_block():
    kv, _ = manager()
    prompt = list(range(12))
    run_request(kv, "a", prompt)
    kv.free("a")
    _, num_hit = run_request(kv, "b", prompt)
    assert num_hit == 8  # 3 cached blocks, but the last one is recomputed for its logits


def test_freed_blocks_stay_cached_until_evicted_tail_first():
    kv, sink = manager(6)
    prompt = list(range(12))  # 3 full blocks
    t1, _ = run_request(kv, "a", prompt)
    kv.free("a")
    assert kv.pool.num_cached_blocks == 3
    # uncached free blocks go first; then the finished request's tail before its head
    order = kv.pool.eviction_order()
    assert order[-3:] == [t1[2], t1[1], t1[0]]
    assert kv.allocate_slots("b", 16) is not None  # 4 blocks: 3 never-used + the cached tail
    removed = [e.event for e in sink.events if isinstance(e.event, BlockRemoved)]
    assert removed and removed[-1].block_hashes == (hash_blocks(prompt, BS, NS)[2],)
    hits, _ = kv.find_cached_prefix(hash_blocks(prompt + [1], BS, NS), 13)
    assert [b.block_id for b in hits] == t1[:2]  # the head survives
    kv.free("b")
    kv.check_integrity()


def test_double_free_is_caught():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="ref_count 0"):
        pool.free(blocks)


def test_a_window_gives_back_the_blocks_no_later_position_sees():
    """Window 10, blocks of 4: the position 21 sees 12..21, so blocks 0-2 (positions 0..11) go back,
    tail first, with their cached content; the table keeps its places, and the end frees the rest."""
    ns = make_namespace("m")
    kv = KVCacheManager(16, 4, window=10)
    tokens = list(range(24))
    hashes = hash_blocks(tokens, 4, ns)
    assert kv.allocate_slots("r", 24) is not None
    table = kv.block_ids("r")
    kv.cache_computed("r", tokens, hashes, 21)
    assert kv.free_out_of_window("r", 21) == 3
    assert kv.block_ids("r") == table
    assert kv.pool.num_free_blocks == 16 - 6 + 3
    assert kv.pool.eviction_order()[-3:] == [table[2], table[1], table[0]]
    assert [kv.pool.lookup(h).block_id for h in hashes[:3]] == table[:3]  # still a prefix to reuse
    assert kv.free_out_of_window("r", 21) == 0 and kv.free_out_of_window("r", 22) == 0
    assert kv.free_out_of_window("r", 23) == 0  # 23 sees 14..23: block 3 (12..15) is still seen
    assert kv.free_out_of_window("r", 25) == 1  # 25 sees 16..25
    kv.check_integrity()
    kv.free("r")
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 16


def test_without_a_window_or_before_it_nothing_is_given_back():
    kv = KVCacheManager(8, 4)
    kv.allocate_slots("r", 20)
    assert kv.free_out_of_window("r", 19) == 0
    windowed = KVCacheManager(8, 4, window=16)
    windowed.allocate_slots("r", 20)
    assert windowed.free_out_of_window("r", 18) == 0  # 18 sees 3..18: block 0 (0..3) is still seen
    assert windowed.free_out_of_window("r", 19) == 1  # 19 sees 4..19
    with pytest.raises(ValueError, match="positive"):
        KVCacheManager(8, 4, window=0)
