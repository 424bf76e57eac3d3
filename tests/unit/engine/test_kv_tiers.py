"""The KV tiers' parts without a model: the pool's eviction hook, host and disk tiers moving real
tensors through a tiny pool, damaged files, and a scheduler that lets a request wait for its own
disk blocks only."""

import threading

import pytest
import torch

from shared.engine.request import Request, SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.kvcache.block_pool import BlockPool
from shared.kvcache.events import BlockRemoved, BlockStored, KvEventEmitter, ListSink
from shared.kvcache.hashing import hash_blocks, make_namespace
from shared.kvcache.layout import KvCacheSpec
from shared.kvcache.manager import KVCacheManager
from shared.kvcache.tiers import DiskTier, KvTiers, StoredBlock, TierConfig

BS = 4
NS = make_namespace("m")
SPEC = KvCacheSpec(num_layers=2, num_kv_heads=1, head_dim=3, block_size=BS, dtype=torch.float32)


def tiny(num_blocks=4, **tier_kw):
    """A manager whose pool is a real KV tensor, with tiers attached; each block's KV is filled
    with a value derived from its hash so a wrong copy is visible."""
    events = KvEventEmitter()
    sink = ListSink()
    events.add_sink(sink)
    cache = SPEC.allocate(num_blocks, "cpu")
    tiers = KvTiers(TierConfig(**tier_kw), SPEC, cache, NS, events)
    kv = KVCacheManager(num_blocks, BS, events=events, tiers=tiers)
    return kv, cache, tiers, sink


def compute(kv, cache, rid, tokens):
    """Allocate, 'compute' (fill each block with a function of its hash) and cache a prompt."""
    hashes = hash_blocks(tokens, BS, NS)
    hits, num_hit = kv.find_cached_prefix(hashes, len(tokens) + 1)
    table = kv.allocate_slots(rid, len(tokens) + 1, hits)
    for i, h in enumerate(hashes[len(hits):], start=len(hits)):
        cache[table[i]] = float(h % 1000)
    kv.cache_computed(rid, tokens, hashes, len(tokens))
    return hashes, num_hit


def test_the_pool_shows_evicted_blocks_with_their_content_before_forgetting_it():
    seen = []
    pool = BlockPool(2, on_evict=lambda blocks: seen.extend((b.block_hash, b.parent_hash, b.token_ids)
                                                            for b in blocks))
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], BS)
    pool.free(list(reversed(blocks)))
    pool.allocate(1)
    assert seen == [(12, 11, (5, 6, 7, 8))]  # the tail goes first, with its parent and tokens
    assert pool.lookup(12) is None and pool.lookup(11) is not None


def test_host_tier_brings_an_evicted_prefix_back_with_its_kv():
    kv, cache, tiers, sink = tiny(num_blocks=3, host_bytes=16 * SPEC.bytes_per_block)
    a = list(range(1, 9))  # two full blocks
    hashes, _ = compute(kv, cache, "a", a)
    kv.free("a")
    compute(kv, cache, "b", list(range(100, 108)))  # evicts a's blocks
    kv.free("b")
    assert kv.pool.lookup(hashes[0]) is None and tiers.counters.offloaded_host == 2
    assert {h for e in sink.events if isinstance(e.event, BlockStored) and e.event.tier == "host"
            for h in e.event.block_hashes} == set(hashes)
    hits, num_hit = kv.find_cached_prefix(hashes, len(a) + 1)
    assert num_hit == 8 and [b.block_hash for b in hits] == hashes
    for block, h in zip(hits, hashes):
        assert torch.all(cache[block.block_id] == float(h % 1000))
    assert tiers.counters.onboarded == 2
    kv.check_integrity()


def test_onboarding_waits_until_the_rest_of_the_request_fits():
    kv, cache, tiers, _ = tiny(num_blocks=3, host_bytes=16 * SPEC.bytes_per_block)
    hashes, _ = compute(kv, cache, "a", list(range(1, 9)))
    kv.free("a")
    compute(kv, cache, "b", list(range(100, 108)))  # b keeps its 3 blocks: no room to onboard
    assert kv.find_cached_prefix(hashes, 9) == ([], 0)
    assert tiers.counters.onboarded == 0
    kv.free("b")
    assert kv.find_cached_prefix(hashes, 9)[1] == 8


def test_disk_tier_round_trip_restart_and_budget(tmp_path):
    disk = DiskTier(tmp_path, 2, SPEC, NS)
    tokens = [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]
    hashes = hash_blocks([t for b in tokens for t in b], BS, NS)
    data = [torch.full((2, 2, BS, 1, 3), float(i)) for i in range(3)]
    parents = [None, hashes[0], hashes[1]]
    assert disk.write(StoredBlock(hashes[0], parents[0], tokens[0], data[0])) == []
    assert disk.write(StoredBlock(hashes[1], parents[1], tokens[1], data[1])) == []
    again = DiskTier(tmp_path, 2, SPEC, NS)
    assert again.scan() == 2
    block = again.read(hashes[1])
    assert block.parent_hash == hashes[0] and block.token_ids == tokens[1] and torch.equal(block.data, data[1])
    assert again.write(StoredBlock(hashes[2], parents[2], tokens[2], data[2])) == [hashes[0]]  # LRU out
    assert not (tmp_path / f"{hashes[0]:016x}.kvb").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "renamed", "garbage"])
def test_a_damaged_file_is_a_miss_and_is_dropped(tmp_path, damage):
    disk = DiskTier(tmp_path, 8, SPEC, NS)
    tokens = (1, 2, 3, 4, 5, 6, 7, 8)
    h0, h1 = hash_blocks(list(tokens), BS, NS)
    disk.write(StoredBlock(h0, None, tokens[:4], torch.ones(2, 2, BS, 1, 3)))
    disk.write(StoredBlock(h1, h0, tokens[4:], torch.ones(2, 2, BS, 1, 3)))
    path = tmp_path / f"{h0:016x}.kvb"
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-1] ^= 1
    elif damage == "truncate":
        raw = raw[:-4]
    elif damage == "renamed":  # block 1's file under block 0's name
        raw = bytearray((tmp_path / f"{h1:016x}.kvb").read_bytes())
    else:
        raw = bytearray(b"not a block")
    path.write_bytes(bytes(raw))
    assert disk.read(h0) is None
    assert not path.exists() and h0 not in disk
    assert disk.read(h1) is not None


def test_disk_tier_reads_a_prefix_in_the_background_and_only_its_request_waits(tmp_path):
    kv, cache, tiers, sink = tiny(num_blocks=4, disk_dir=str(tmp_path), disk_min_uses=1)
    a = list(range(1, 9))
    hashes, _ = compute(kv, cache, "a", a)
    kv.free("a")
    compute(kv, cache, "b", list(range(100, 112)))  # three blocks: evicts a's two
    kv.free("b")
    assert tiers.flush() and tiers.counters.offloaded_disk == 2
    tiers.close()

    kv, cache, tiers, sink = tiny(num_blocks=4, disk_dir=str(tmp_path), disk_min_uses=1)
    tiers.announce_disk()
    assert {h for e in sink.events if isinstance(e.event, BlockStored) and e.event.tier == "disk"
            for h in e.event.block_hashes} >= set(hashes)
    scheduler = Scheduler(SchedulerConfig(8, 64, 1024), kv, NS)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    reads = []
    real_read = tiers.disk.read
    release = threading.Event()

    def slow_read(h):
        release.wait(5)
        reads.append(h)
        return real_read(h)

    tiers.disk.read = slow_read
    scheduler.add_request(Request("a2", a + [50], params))       # its prefix is on disk
    scheduler.add_request(Request("other", [200, 201, 202], params))
    first = scheduler.schedule()
    assert [s.request.request_id for s in first.scheduled] == ["other"]  # a2 waits for its blocks
    release.set()
    tiers.wait_loading(5)
    second = scheduler.schedule()
    a2 = next(s for s in second.scheduled if s.request.request_id == "a2")
    assert a2.start == 8 and reads == hashes  # both blocks came from disk
    for i, h in enumerate(hashes):
        assert torch.all(cache[a2.block_ids[i]] == float(h % 1000))
    assert tiers.counters.onboarded_disk == 2
    assert not any(isinstance(e.event, BlockRemoved) and e.event.tier == "disk" for e in sink.events)
    tiers.close()


def test_the_frequency_filter_counts_computations_and_hits(tmp_path):
    kv, cache, tiers, _ = tiny(num_blocks=3, disk_dir=str(tmp_path), disk_min_uses=2)
    compute(kv, cache, "a", list(range(1, 5)))  # a's block: used once
    kv.free("a")
    compute(kv, cache, "b", list(range(10, 14)))
    kv.free("b")
    _, num_hit = compute(kv, cache, "b2", list(range(10, 14)) + [99])  # b's block is hit: second use
    kv.free("b2")
    compute(kv, cache, "c", list(range(20, 28)))  # evicts a's block and b's
    kv.free("c")
    assert tiers.flush()
    assert num_hit == 4 and tiers.counters.offloaded_disk == 1
    tiers.close()


def test_an_unusable_disk_directory_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot use .*file"):
        DiskTier(tmp_path / "file" / "tier", 8, SPEC, NS)


def test_a_holder_lends_a_prefix_it_keeps_only_on_disk_once_read_in(tmp_path):
    """What a peer fetch does on the holder (KvReservations.read_prefix_from_disk, then lend_prefix):
    a restarted worker reads its disk blocks in, and lends the whole run with its KV."""
    kv, cache, tiers, _ = tiny(num_blocks=4, disk_dir=str(tmp_path), disk_min_uses=1)
    a = list(range(1, 9))
    hashes, _ = compute(kv, cache, "a", a)
    kv.free("a")
    tiers.persist(kv.pool.cached_blocks())
    tiers.close()

    kv, cache, tiers, _ = tiny(num_blocks=4, disk_dir=str(tmp_path), disk_min_uses=1)
    assert kv.lend("early", hashes) == []  # nothing in the pool or in host memory yet
    kv.prefetch(hashes)
    tiers.wait_loading(5)
    assert not kv.is_loading(hashes)
    lent = kv.lend("lend:1", hashes)
    assert len(lent) == 2
    for block_id, h in zip(lent, hashes):
        assert torch.all(cache[block_id] == float(h % 1000))
    kv.free("lend:1")
    kv.check_integrity()
    tiers.close()
