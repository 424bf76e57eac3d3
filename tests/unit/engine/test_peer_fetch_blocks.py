"""The block bookkeeping of a prefix fetch between two pools, without a model: the holder pins
(lends) its cached run, the asking side holds blocks for the missing part, the "write" is a copy
between two real KV tensors, and only the blocks written become cached."""

import torch

from shared.kvcache.hashing import hash_blocks, make_namespace
from shared.kvcache.layout import KvCacheSpec
from shared.kvcache.manager import KVCacheManager

BS = 4
NS = make_namespace("m")
SPEC = KvCacheSpec(num_layers=2, num_kv_heads=1, head_dim=3, block_size=BS, dtype=torch.float32)
PROMPT = list(range(100, 124))  # 6 full blocks


def pool(num_blocks=8):
    return KVCacheManager(num_blocks, BS), SPEC.allocate(num_blocks, "cpu")


def computed(kv, cache, rid, tokens):
    """A request that computed ``tokens`` (each block's KV = a value derived from its hash) and ended."""
    hashes = hash_blocks(tokens, BS, NS)
    table = kv.allocate_slots(rid, len(tokens) + 1)
    for block_id, h in zip(table, hashes):
        cache[block_id] = float(h % 997)
    kv.cache_computed(rid, tokens, hashes, len(tokens))
    kv.free(rid)
    return hashes


def test_a_fetch_fills_the_missing_blocks_and_caches_exactly_those_written():
    a, a_cache = pool()
    hashes = computed(a, a_cache, "r", PROMPT)
    b, b_cache = pool()
    computed(b, b_cache, "mine", PROMPT[:2 * BS])  # B holds the first two blocks itself

    num_local, fresh = b.reserve_fetch("fetch:1", hashes)
    assert num_local == 2 and len(fresh) == 4
    lent = a.lend("lend:1", hashes)
    assert len(lent) == 6 and all(a.pool.blocks[i].ref_count == 1 for i in lent)  # pinned
    written = 3  # the holder wrote a shorter run than asked (say it lost one block meanwhile)
    for src, dst in zip(lent[num_local:num_local + written], fresh):
        b_cache[dst] = a_cache[src]
    a.free("lend:1")
    b.finish_fetch("fetch:1", PROMPT, hashes, num_local + written)

    hits, num_hit = b.find_cached_prefix(hashes, len(PROMPT) + 1)
    assert num_hit == 5 * BS  # two of its own, three fetched; the sixth was not written
    for block, h in zip(hits, hashes):
        assert torch.equal(b_cache[block.block_id], torch.full_like(b_cache[block.block_id], float(h % 997)))
    a.check_integrity()
    b.check_integrity()
    assert b.pool.num_free_blocks == 8 and a.pool.num_free_blocks == 8


def test_a_fetch_given_up_caches_nothing_and_frees_every_block():
    b, _ = pool()
    hashes = hash_blocks(PROMPT, BS, NS)
    num_local, fresh = b.reserve_fetch("fetch:2", hashes)
    assert num_local == 0 and len(fresh) == 6 and b.pool.num_free_blocks == 2
    b.finish_fetch("fetch:2", PROMPT, hashes, 0)
    assert b.find_cached_prefix(hashes, len(PROMPT) + 1) == ([], 0)
    assert b.pool.num_free_blocks == 8
    b.check_integrity()


def test_nothing_is_reserved_when_every_block_is_here_or_the_pool_is_short():
    b, b_cache = pool()
    hashes = computed(b, b_cache, "r", PROMPT)
    assert b.reserve_fetch("fetch:3", hashes) == (6, [])
    small, _ = pool(num_blocks=4)
    assert small.reserve_fetch("fetch:4", hashes) is None  # six blocks do not fit in four
    small.check_integrity()
    assert small.pool.num_free_blocks == 4


def test_lending_an_unknown_prefix_pins_nothing():
    a, _ = pool()
    assert a.lend("lend:2", hash_blocks(PROMPT, BS, NS)) == []
    a.free("lend:2")
    a.check_integrity()
