"""Waiting out admission's 429s for load rather than failing: a background response (its caller
is not there to retry) and a ``flex`` request (its client asked to wait rather than fail, as
OpenAI's flex processing does) ask again after each rejection's Retry-After, up to a bound."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from shared.openai_api.errors import ApiError

log = logging.getLogger(__name__)

T = TypeVar("T")

# admission's 429s that are answers, not load: the same request is rejected again however long it waits
_FINAL_REJECTIONS = ("prompt_too_long", "deadline")
_MIN_RETRY_WAIT_S = 0.5
_DEFAULT_RETRY_WAIT_S = 1.0  # a 429 without a Retry-After


def retry_wait_s(exc: ApiError, waited_s: float, max_wait_s: float) -> float | None:
    """How long a request that got ``exc``, after ``waited_s`` of retrying, waits before asking
    again; None: ``exc`` is its end. Admission's 429s for load (``overloaded``, ``slo``,
    ``shedding``, ``tier_queue_full``) are waited out for their Retry-After (at least
    ``_MIN_RETRY_WAIT_S``; ``_DEFAULT_RETRY_WAIT_S`` without one), never past ``max_wait_s`` in
    all: the last try comes when that is up. Every other error, and a 429 that waiting does not
    change (``prompt_too_long``, ``deadline``), ends it at once."""
    if exc.status != 429 or exc.code in _FINAL_REJECTIONS:
        return None
    left_s = max_wait_s - waited_s
    if left_s <= 0:
        return None
    wait_s = _DEFAULT_RETRY_WAIT_S if exc.retry_after_s is None else max(exc.retry_after_s, _MIN_RETRY_WAIT_S)
    return min(wait_s, left_s)


async def waiting_out_429s(attempt: Callable[[], Awaitable[T]], max_wait_s: float, request_id: str) -> T:
    """``attempt()``'s result, asked again after each 429 for load (``retry_wait_s``) for up to
    ``max_wait_s`` in all (0: once); the last error otherwise, its message saying how many tries
    it ended. Each wait is logged as ``<request_id>: 429 <code>; asking again in <s>s``."""
    started, tries = time.monotonic(), 0
    while True:
        tries += 1
        try:
            return await attempt()
        except ApiError as exc:
            waited_s = time.monotonic() - started
            if (wait_s := retry_wait_s(exc, waited_s, max_wait_s)) is None:
                if tries > 1:
                    exc.message += f" (the last of {tries} tries in {waited_s:.0f}s)"
                raise
            log.info("%s: %d %s; asking again in %.1fs", request_id, exc.status, exc.code, wait_s)
            await asyncio.sleep(wait_s)
