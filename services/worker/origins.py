"""Requests whose sender is gone: a worker aborts them instead of generating into a dead inbox.

A gateway that dies (SIGKILL, a lost host) leaves its requests running on the workers: nobody
cancels them, and each runs to ``max_tokens``, taking the batch slots and KV blocks that the
requests retried through another gateway need. Each ``GenerateRequest`` names its sender's
``origin``; the sender answers ``Subjects.origin_alive(origin)``. ``OriginWatch`` asks every
origin with requests here every ``interval_s``. NATS answers "no responders" at once for a
subject nobody serves, so a dead gateway is seen within a round; one that stays unanswered for
``grace_s`` has its requests aborted. A timeout or a lost connection says nothing either way
(NATS itself may be restarting), so it aborts nothing and starts the grace period over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from shared.bus import Bus
from shared.bus.errors import NoResponders
from shared.protocol import GenerateRequest, OriginPing, Subjects

log = logging.getLogger(__name__)


class OriginWatch:
    def __init__(self, bus: Bus, subjects: Subjects, worker_id: str,
                 abort: Callable[[str, str], Awaitable[None]], *, interval_s: float = 0.5,
                 grace_s: float = 1.0, timeout_s: float = 1.0) -> None:
        self._bus, self._subjects, self._worker_id = bus, subjects, worker_id
        self._abort = abort  # (request id, reason)
        self.interval_s, self.grace_s, self.timeout_s = interval_s, grace_s, timeout_s
        self._requests: dict[str, dict[str, None]] = {}  # origin → its request ids running here
        self._missing_since: dict[str, float] = {}       # origin → first "no responders" in a row
        self.num_aborted = 0

    def add(self, request: GenerateRequest) -> None:
        if request.origin is not None:
            self._requests.setdefault(request.origin, {})[request.request_id] = None

    def remove(self, request: GenerateRequest) -> None:
        if request.origin is None or (ids := self._requests.get(request.origin)) is None:
            return
        ids.pop(request.request_id, None)
        if not ids:
            del self._requests[request.origin]
            self._missing_since.pop(request.origin, None)

    async def check(self, now: float | None = None) -> list[str]:
        """One round over the origins with requests here; returns the request ids aborted."""
        aborted: list[str] = []
        origins = list(self._requests)
        answers = await asyncio.gather(*(self._gone(origin) for origin in origins))
        now = time.monotonic() if now is None else now
        for origin, gone in zip(origins, answers):
            if not gone:
                self._missing_since.pop(origin, None)
                continue
            since = self._missing_since.setdefault(origin, now)
            if now - since < self.grace_s or origin not in self._requests:
                continue
            ids = list(self._requests.pop(origin))
            del self._missing_since[origin]
            log.warning("origin %s is gone (nobody has answered for %.1fs): aborting its %d requests",
                        origin, now - since, len(ids))
            for request_id in ids:
                await self._abort(request_id, f"origin {origin} is gone")
            self.num_aborted += len(ids)
            aborted += ids
        return aborted

    async def _gone(self, origin: str) -> bool:
        """True only on "no responders"; a reply, a timeout or an error say it may be there."""
        ping = OriginPing(worker_id=self._worker_id, num_requests=len(self._requests.get(origin, ())))
        try:
            await self._bus.request(self._subjects.origin_alive(origin), ping, timeout_s=self.timeout_s)
        except NoResponders:
            return True
        except Exception as exc:  # noqa: BLE001 — a timeout or NATS reconnecting: cannot say
            log.debug("origin %s: no answer (%s)", origin, exc)
        return False

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception:  # noqa: BLE001 — the next round tries again
                log.exception("origin check failed")
