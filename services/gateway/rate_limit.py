"""The gateway's rate limit as a middleware: every API call (``is_limited_path``) takes one token of
its client's bucket (``SharedRateLimiter``: in Redis for every gateway of the stack) before its
handler runs, or is answered 429 ``rate_limit_exceeded`` with ``Retry-After``."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from shared.openai_api.auth import ApiKeys
from shared.openai_api.errors import ApiError
from shared.policy.rate_limit import is_limited_path
from shared.store.rate_limit import SharedRateLimiter


def rate_limit_middleware(limiter: SharedRateLimiter, api_keys: ApiKeys):
    @web.middleware
    async def middleware(request: web.Request, handler):
        if is_limited_path(request.path):
            await check_rate(limiter, api_keys, request)
        return await handler(request)

    return middleware


async def check_rate(limiter: SharedRateLimiter, api_keys: ApiKeys, request: web.Request) -> None:
    """A 429 when this client (its API key, else its address) is over its rate. A request without
    a known key spends nobody's tokens: its handler answers it 401 (or serves it, on a path open
    without a key)."""
    authorization = request.headers.get("Authorization")
    try:
        api_keys.tier(authorization)
    except ApiError:
        return
    client_id = api_keys.client_id(authorization, request.remote)
    wait_s = await limiter.acquire(client_id, time.monotonic())
    if wait_s is not None:
        raise ApiError(429, f"rate limit exceeded ({limiter.rate_per_s:g} requests/s, burst {limiter.burst}); "
                       f"retry in {wait_s:.1f}s", code="rate_limit_exceeded", retry_after_s=math.ceil(wait_s))


@asynccontextmanager
async def closing_limiter(limiter: SharedRateLimiter | None) -> AsyncIterator[None]:
    """Close ``limiter``'s Redis connections (if any) when the block ends."""
    try:
        yield
    finally:
        if limiter is not None:
            await limiter.aclose()
