"""The rate limit's token buckets in Redis (``shared.store.rate_limit``) against a real redis-server:
the script's refill and refusal on a clock the test passes in (``now_us``), its atomicity across
clients, its key expiry; and the fall back to the per-process buckets when Redis is gone or silent.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.stack.servers import start_redis_server
from shared.policy.rate_limit import RateLimiter
from shared.store import RedisKeys, connect
from shared.store.rate_limit import RedisRateBuckets, SharedRateLimiter, open_rate_limiter

S = 1_000_000  # microseconds


@pytest.fixture
async def buckets_for(redis_url, namespace):
    clients = []

    def make(rate_per_s: float, burst: int) -> RedisRateBuckets:
        client = connect(redis_url)
        clients.append(client)
        return RedisRateBuckets(client, RedisKeys(namespace), rate_per_s, burst)

    yield make
    for client in clients:
        await client.aclose()


async def test_a_burst_then_one_request_per_refill_and_the_wait_until_the_next_token(buckets_for):
    buckets = buckets_for(rate_per_s=2.0, burst=3)
    t0 = 100 * S
    assert [await buckets.take("key:a", now_us=t0) for _ in range(3)] == [None, None, None]
    assert await buckets.take("key:a", now_us=t0) == pytest.approx(0.5)  # one token takes 1/2 s
    assert await buckets.take("key:a", now_us=t0 + S // 5) == pytest.approx(0.3)  # 0.4 of a token there
    assert await buckets.take("key:a", now_us=t0 + S // 2) is None  # refused tries cost nothing
    assert await buckets.take("key:a", now_us=t0 + S // 2) == pytest.approx(0.5)


async def test_refill_stops_at_the_burst_and_a_clock_step_back_refills_nothing(buckets_for):
    buckets = buckets_for(rate_per_s=10.0, burst=2)
    assert await buckets.take("key:a", now_us=50 * S) is None
    assert await buckets.take("key:a", now_us=50 * S) is None
    assert await buckets.take("key:a", now_us=3600 * S) is None  # an hour later: full (2), not 36,000
    assert await buckets.take("key:a", now_us=3600 * S) is None
    assert await buckets.take("key:a", now_us=3599 * S) == pytest.approx(0.1)  # earlier "now": nothing appears


async def test_clients_have_their_own_buckets_and_every_gateway_the_same_one(buckets_for):
    first, second = buckets_for(rate_per_s=1.0, burst=2), buckets_for(rate_per_s=1.0, burst=2)
    assert await first.take("key:a", now_us=0) is None
    assert await second.take("key:a", now_us=0) is None  # another client of Redis: the same bucket
    assert await first.take("key:a", now_us=0) == pytest.approx(1.0)
    assert await second.take("key:b", now_us=0) is None


async def test_concurrent_takes_from_two_clients_admit_exactly_the_burst(buckets_for):
    first, second = buckets_for(rate_per_s=0.001, burst=10), buckets_for(rate_per_s=0.001, burst=10)
    waits = await asyncio.gather(*(b.take("key:a", now_us=7 * S) for _ in range(20) for b in (first, second)))
    assert sum(w is None for w in waits) == 10


async def test_redis_time_is_the_clock_when_none_is_passed(buckets_for):
    buckets = buckets_for(rate_per_s=0.5, burst=2)
    assert await buckets.take("key:a") is None and await buckets.take("key:a") is None
    wait_s = await buckets.take("key:a")
    assert wait_s is not None and 0 < wait_s <= 2.0  # under one token's refill (1 / 0.5 s)


async def test_a_bucket_expires_once_it_would_be_full_and_holds_no_api_key(buckets_for, redis_url, namespace):
    buckets = buckets_for(rate_per_s=4.0, burst=2)
    await buckets.take("key:sk-secret", now_us=0)
    client = connect(redis_url)
    try:
        stored = [k async for k in client.scan_iter(match=RedisKeys(namespace).all_prefix() + "*")]
        assert stored == [RedisKeys(namespace).rate_bucket("key:sk-secret")]
        assert "sk-secret" not in stored[0]
        # one token short of full: refilled in 1/4 s; the key lives that long plus a second's margin
        assert 0 < await client.pttl(stored[0]) <= 250 + 1000
    finally:
        await client.aclose()


async def test_a_redis_that_goes_away_falls_back_to_the_local_limit_logged_once_and_comes_back(
        tmp_path, namespace, caplog):
    (tmp_path / "redis").mkdir()
    server = start_redis_server(tmp_path / "redis")
    limiter = open_rate_limiter(0.001, 2, server.url, namespace, timeout_s=1.0, retry_s=10.0)
    caplog.set_level(logging.INFO, logger="shared.store.rate_limit")
    try:
        assert await limiter.acquire("key:a", now_s=0.0) is None
        assert await limiter.acquire("key:a", now_s=0.0) is None
        assert await limiter.acquire("key:a", now_s=0.0) is not None  # Redis's bucket is empty
        server.stop()
        # the local bucket starts full: a key gets a burst more while Redis is away, never a 5xx
        assert await limiter.acquire("key:a", now_s=1.0) is None and limiter.is_falling_back
        assert await limiter.acquire("key:a", now_s=2.0) is None
        assert await limiter.acquire("key:a", now_s=3.0) is not None
        assert await limiter.acquire("key:a", now_s=12.0) is not None  # asked again, still gone: local
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "per gateway process" in warnings[0].getMessage()
        server = start_redis_server(tmp_path / "redis", port=server.port)  # back, without the buckets
        assert await limiter.acquire("key:b", now_s=15.0) is None  # before the retry: local still
        assert limiter.is_falling_back
        assert await limiter.acquire("key:b", now_s=30.0) is None  # asked again: Redis answers
        assert not limiter.is_falling_back
        assert "shared through Redis" in caplog.records[-1].getMessage()
    finally:
        await limiter.aclose()
        server.stop()


async def test_a_redis_that_does_not_answer_times_out_to_the_local_limit(namespace):
    """A server that accepts the connection and never replies (a hung Redis, a black-holed route)."""
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limiter = open_rate_limiter(1.0, 1, f"redis://127.0.0.1:{port}/0", namespace, timeout_s=0.2)
    try:
        assert await limiter.acquire("key:a", now_s=0.0) is None
        assert limiter.is_falling_back
        assert await limiter.acquire("key:a", now_s=0.0) == pytest.approx(1.0)  # the local bucket's wait
    finally:
        await limiter.aclose()
        for writer in held:
            writer.close()
        server.close()


async def test_without_redis_the_limit_is_per_process(namespace):
    limiter = open_rate_limiter(1.0, 1, None, namespace, timeout_s=0.2)
    assert isinstance(limiter, SharedRateLimiter) and limiter.shared is None
    assert isinstance(limiter.local, RateLimiter)
    assert await limiter.acquire("key:a", now_s=0.0) is None
    assert await limiter.acquire("key:a", now_s=0.5) == pytest.approx(0.5)
