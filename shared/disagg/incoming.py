"""The KV writes a decode worker expects from peers, and the blocks it holds until no late write
can land: the one owner both remote prefill (``remote_prefill``) and peer fetch (``peer_fetch``)
drive. Pure: time only comes in as ``now``; the service polls the transfer and ticks.

Life of one write, named by its transfer id (a remote prefill's ``transfer_id``, a fetch's
``fetch_id``): ``expect`` it (a future, resolved at most once); ``deliver`` the NIXL notifications
(the first for a waiting transfer resolves it, later ones are repeats); ``end_wait`` ends a wait
early (cancelled, publish failed, lease lapsed) and ``tick(now)`` ends those past their
``wait_until`` (resolved with None: no KV); ``forget`` it once its waiter moved on. Blocks that a
late write may still hit are ``hold``-ed until a time and handed to ``release`` by the first tick
at or after it; ``held_until`` says when the last goes, for a worker that drains.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import ValidationError

from shared.protocol import PrefillNotification


class Delivery(enum.Enum):
    TAKEN = "taken"  # resolved a waiting transfer
    REPEATED = "repeated"  # names an expected transfer whose wait is already over
    UNKNOWN = "unknown"  # names no transfer expected here (another receiver's, or forgotten)
    MALFORMED = "malformed"  # not a notification at all


@dataclass
class ExpectedWrite:
    transfer_id: str
    request_id: str
    wait_until: float  # epoch seconds; inf: only a notification or ``end_wait`` ends the wait
    future: asyncio.Future[PrefillNotification | None] = field(repr=False)
    received_at: float | None = None  # as the poller dated the notification that resolved it


class IncomingWrites:
    def __init__(self, release: Callable[[str], None]) -> None:
        self._release = release  # hands a held key's blocks back (to the engine)
        self._expected: dict[str, ExpectedWrite] = {}  # transfer id → its wait, in the order expected
        self._held: list[tuple[float, str]] = []  # heap of (may go back at, key)

    # -- waits ----------------------------------------------------------------------------------------
    def expect(self, transfer_id: str, request_id: str, *,
               wait_until: float = math.inf) -> asyncio.Future[PrefillNotification | None]:
        """Wait for the write named ``transfer_id``; the future resolves with its notification, or
        None once the wait ended without one. Needs a running event loop."""
        assert transfer_id not in self._expected, f"transfer {transfer_id} is expected already"
        future = asyncio.get_running_loop().create_future()
        self._expected[transfer_id] = ExpectedWrite(transfer_id, request_id, wait_until, future)
        return future

    def deliver(self, payload: bytes,
                received_at: float | None = None) -> tuple[Delivery, PrefillNotification | None]:
        """A NIXL notification: what it was, and the notification (None if malformed)."""
        try:
            note = PrefillNotification.from_bytes(payload)
        except ValidationError:
            return Delivery.MALFORMED, None
        expected = self._expected.get(note.transfer_id)
        if expected is None:
            return Delivery.UNKNOWN, note
        if expected.future.done():
            return Delivery.REPEATED, note
        expected.received_at = received_at
        expected.future.set_result(note)
        return Delivery.TAKEN, note

    def is_waiting(self, transfer_id: str) -> bool:
        expected = self._expected.get(transfer_id)
        return expected is not None and not expected.future.done()

    @property
    def has_waiting(self) -> bool:
        return bool(self._expected)

    def end_wait(self, transfer_id: str) -> ExpectedWrite | None:
        """Stop waiting (the future resolves with None); returns the wait if it was still open."""
        expected = self._expected.get(transfer_id)
        if expected is None or expected.future.done():
            return None
        expected.future.set_result(None)
        return expected

    def forget(self, transfer_id: str) -> ExpectedWrite | None:
        """The waiter moved on: a notification naming it from now on is ``UNKNOWN``."""
        return self._expected.pop(transfer_id, None)

    # -- blocks a late write may still hit ------------------------------------------------------------
    def hold(self, key: str, until: float) -> None:
        """Give ``key``'s blocks back at the first tick at or after ``until``, not before."""
        heapq.heappush(self._held, (until, key))

    @property
    def held_until(self) -> float | None:
        """When the last held blocks may go back; None: none held."""
        return max((at for at, _ in self._held), default=None)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def tick(self, now: float) -> list[ExpectedWrite]:
        """End the waits past their ``wait_until`` (returned, for the caller to say why) and give
        back the held blocks whose time has come."""
        ended = [e for e in list(self._expected.values()) if now >= e.wait_until and self.end_wait(e.transfer_id)]
        while self._held and self._held[0][0] <= now:
            self._release(heapq.heappop(self._held)[1])
        return ended
