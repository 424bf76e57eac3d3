"""The kv-index's Redis layout against a real redis-server."""

import pytest

from shared.protocol import (AllBlocksClearedEvent, BlockRemovedEvent, BlockStoredEvent,
                             KvEventBatch)
from shared.policy.kv_routing import effective_overlap
from shared.store import KvIndexStore, RedisKeys, connect
from shared.store.kv_index import TierOverlap


@pytest.fixture
async def store(redis_url, namespace):
    client = connect(redis_url)
    yield KvIndexStore(client, RedisKeys(namespace)), client
    await client.aclose()


def stored(seq, hashes, tier="gpu"):
    return BlockStoredEvent(seq=seq, timestamp=0.0, block_hashes=hashes, tier=tier)


async def test_match_walks_prefix_and_stops_at_first_unheld_block(store):
    s, _ = store
    await s.apply(KvEventBatch(worker_id="a", events=[stored(1, [10, 11, 12])]), 1, now=1.0)
    await s.apply(KvEventBatch(worker_id="b", events=[stored(1, [10, 11]), stored(2, [13])]), 2, now=1.0)
    assert await s.match([10, 11, 12, 13]) == {"a": 3, "b": 2}
    assert await s.match([10, 99, 12]) == {"a": 1, "b": 1}
    assert await s.match(list(range(10, 13)) + list(range(200, 400))) == {"a": 3, "b": 2}
    assert await s.owners(10) == {"a", "b"}
    assert await s.stream_seq() == 2
    assert await s.worker_seqs() == {"a": 1, "b": 2}


async def test_match_counts_blocks_held_only_below_the_pool(store):
    s, _ = store
    await s.apply(KvEventBatch(worker_id="a", events=[
        stored(1, [10, 11, 12, 13]), stored(2, [11, 12], tier="host"), stored(3, [13], tier="disk"),
        BlockRemovedEvent(seq=4, timestamp=0.0, block_hashes=[12, 13])]), 1, now=1.0)
    await s.apply(KvEventBatch(worker_id="b", events=[stored(1, [10], tier="disk"), stored(2, [11], tier="host")]),
                  2, now=1.0)
    # a: 10, 11 in its pool (11 also in host: the pool counts), 12 in host only, 13 on disk only
    assert await s.match_tiers([10, 11, 12, 13, 14]) == {"a": TierOverlap(4, 1, 1), "b": TierOverlap(2, 1, 1)}
    assert await s.match([10, 11, 12, 13]) == {"a": 4, "b": 2}
    # the routing rule counts a block below the pool as part of a hit
    assert 2 < effective_overlap(4, 1, 1) < 4 and effective_overlap(2, 0, 0) == 2


async def test_removed_cleared_and_dropped_workers_leave_no_keys(store, namespace):
    s, client = store
    await s.apply(KvEventBatch(worker_id="a", events=[stored(1, [1, 2, 3]), stored(2, [3], tier="cpu")]),
                  1, now=1.0)
    await s.apply(KvEventBatch(worker_id="a", events=[
        BlockRemovedEvent(seq=3, timestamp=0.0, block_hashes=[3])]), 2, now=2.0)
    assert await s.match([1, 2, 3]) == {"a": 3}  # still held in the cpu tier
    await s.apply(KvEventBatch(worker_id="b", events=[stored(1, [1])]), 3, now=2.0)
    await s.apply(KvEventBatch(worker_id="a", events=[AllBlocksClearedEvent(seq=4, timestamp=0.0)]),
                  4, now=3.0)
    assert await s.match([1, 2]) == {"b": 1}
    assert await s.drop_worker("b") == 1
    assert await s.match([1]) == {}
    assert await s.drop_worker("a") == 0  # cleared: only its bookkeeping is left
    keys = await client.keys(RedisKeys(namespace).all_prefix() + "*")
    assert sorted(keys) == [RedisKeys(namespace).stream_seq()]
