"""Waiting for a condition that no event announces (a TTL expiring, a port answering)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def wait_until(check: Callable[[], Awaitable[T]], *, timeout_s: float, interval_s: float = 0.05,
                     what: str = "condition") -> T:
    """Await ``check()`` until it returns something truthy; raise ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s}s (last: {result!r})")
        await asyncio.sleep(interval_s)
