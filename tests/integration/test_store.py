"""The kv-index's Redis layout against a real redis-server."""

import pytest

from shared.protocol import (AllBlocksClearedEvent, BlockRemovedEvent, BlockStoredEvent,
                             KvEventBatch)
from shared.store import KvIndexStore, RedisKeys, connect


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
