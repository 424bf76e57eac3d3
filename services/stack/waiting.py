"""Waiting for a condition that no event announces (a TTL expiring, a port answering)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def wait_until(check: Callable[[], Awaitable[T] | T], *, timeout_s: float, interval_s: float = 0.05,
                     what: str = "condition") -> T:
    """Call ``check()`` (awaiting what it returns, if awaitable: a coroutine function or a plain one) until
    it gives something truthy; raise ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s}s (last: {result!r})")
        await asyncio.sleep(interval_s)
