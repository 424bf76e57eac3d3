"""The rate limit shared by every gateway of a stack: one token bucket per client in Redis.

Each request runs one Lua script (EVALSHA, EVAL once the server lacks it) that refills the bucket by
the time elapsed on Redis's own clock (``TIME``: gateways' clocks never need to agree), takes one
token or returns the wait, and sets the key to expire once the bucket would be full again (an absent
key is a full bucket, so idle clients leave nothing behind). The script is atomic, so the limit is
exact across gateways while Redis answers.

When Redis does not answer within ``timeout_s`` (or no Redis is configured), ``SharedRateLimiter``
falls back to the per-process buckets of ``shared.policy.rate_limit``: the limit fails open to N
times itself for N gateways, never to a 5xx. It asks Redis again ``retry_s`` later.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as redis

from shared.policy.rate_limit import RateLimiter
from shared.store.keys import RedisKeys
from shared.store.kv_index import connect, is_unavailable
from shared.telemetry.redact import redact_url

log = logging.getLogger(__name__)

# KEYS[1]: the bucket, a hash {tokens, at_us}. ARGV: rate_per_s, burst, now_us ("": Redis's TIME).
# Returns {1, "0"} when a token was taken, else {0, seconds until one is there} (strings: Redis
# truncates Lua numbers to integers). A clock that stepped back refills nothing.
TAKE_SCRIPT = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at_us')
local tokens = tonumber(state[1])
local at = tonumber(state[2])
if tokens == nil or at == nil then
  tokens, at = burst, now
end
if now > at then
  tokens = math.min(burst, tokens + (now - at) * rate / 1000000)
  at = now
end
local taken = 0
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
  taken = 1
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'at_us', string.format('%.17g', at))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return {taken, string.format('%.17g', wait)}
"""


class RedisRateBuckets:
    """The token buckets in Redis (``RedisKeys.rate_bucket``), one script call per ``take``."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, rate_per_s: float, burst: int) -> None:
        assert rate_per_s > 0 and burst >= 1, f"rate_per_s={rate_per_s} burst={burst}"
        self._client = client
        self._keys = keys
        self._script = client.register_script(TAKE_SCRIPT)
        self.rate_per_s = rate_per_s
        self.burst = burst

    async def take(self, client_id: str, now_us: int | None = None) -> float | None:
        """Take one token of ``client_id``'s bucket: None when taken, else the seconds until one is
        there. ``now_us`` (tests): the clock in microseconds instead of Redis's ``TIME``. Raises
        redis-py's errors (``is_unavailable`` tells which mean Redis is away)."""
        args = [repr(self.rate_per_s), self.burst, "" if now_us is None else now_us]
        taken, wait_s = await self._script(keys=[self._keys.rate_bucket(client_id)], args=args)
        return None if int(taken) else float(wait_s)

    async def aclose(self) -> None:
        await self._client.aclose()


class SharedRateLimiter:
    """``RedisRateBuckets`` while Redis answers within ``timeout_s``; else (or with no Redis) the
    process's own ``RateLimiter``, logged once per switch, with Redis asked again ``retry_s`` later."""

    def __init__(self, local: RateLimiter, shared: RedisRateBuckets | None, *, timeout_s: float,
                 retry_s: float = 5.0, where: str = "") -> None:
        self.local = local
        self.shared = shared
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._where = where  # the Redis URL, redacted, for the log lines
        self._local_until_s = 0.0  # monotonic: Redis failed, the local buckets serve until then
        self.is_falling_back = False

    @property
    def rate_per_s(self) -> float:
        return self.local.rate_per_s

    @property
    def burst(self) -> int:
        return self.local.burst

    async def acquire(self, client_id: str, now_s: float) -> float | None:
        """Admit one request of ``client_id``: None when admitted, else the seconds to wait.
        ``now_s``: the monotonic clock (the local buckets' and the retry's; Redis uses its own)."""
        if self.shared is None or now_s < self._local_until_s:
            return self.local.acquire(client_id, now_s)
        try:
            async with asyncio.timeout(self.timeout_s):
                wait_s = await self.shared.take(client_id)
        except Exception as exc:  # noqa: BLE001 — any Redis trouble: fail open to the local limit
            if not is_unavailable(exc):  # a timeout (TimeoutError is an OSError) or a connection error
                log.exception("rate limit script failed")
            self._fall_back(now_s, exc)
            return self.local.acquire(client_id, now_s)
        if self.is_falling_back:
            self.is_falling_back = False
            log.info("rate limit shared through Redis %s again", self._where)
        return wait_s

    def _fall_back(self, now_s: float, exc: BaseException) -> None:
        self._local_until_s = now_s + self.retry_s
        if not self.is_falling_back:
            self.is_falling_back = True
            log.warning("rate limit per gateway process: Redis %s failed or did not answer within %gs (%s); "
                        "asking it again every %gs", self._where, self.timeout_s,
                        str(exc) or type(exc).__name__, self.retry_s)

    async def aclose(self) -> None:
        if self.shared is not None:
            await self.shared.aclose()


def open_rate_limiter(rate_per_s: float, burst: int, redis_url: str | None, namespace: str, *,
                      timeout_s: float, retry_s: float = 5.0) -> SharedRateLimiter:
    """The limiter for a gateway: shared through ``redis_url`` when one is given (it connects on
    first use), else (said once here) per process."""
    local = RateLimiter(rate_per_s, burst)
    if not redis_url:
        log.info("rate limit per gateway process: no Redis configured (redis_url)")
        return SharedRateLimiter(local, None, timeout_s=timeout_s)
    buckets = RedisRateBuckets(connect(redis_url, timeout_s=timeout_s), RedisKeys(namespace), rate_per_s, burst)
    log.info("rate limit %g requests/s (burst %d) per client, shared through Redis %s", rate_per_s, burst,
             redact_url(redis_url))
    return SharedRateLimiter(local, buckets, timeout_s=timeout_s, retry_s=retry_s, where=redact_url(redis_url))
