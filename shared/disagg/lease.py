"""Leases on a remote prefill's reserved blocks: the fence that lets a decode worker free blocks
reserved for a prefill worker that died within seconds, not at the end of its whole window.

A prefill worker may write into a reservation only under a lease the decode worker granted it,
renewed while it works (``PrefillLease``), and starts a write only while the lease outlasts the
write's timeout (``may_start_write``). So once every lease granted on a reservation has expired,
no write into it is in flight or can start: the decode worker may reuse its blocks. It grants no
lease once it stops waiting for the KV (``close``), so a presumed-dead peer that wakes up, or a
redelivery, is refused and drops the request instead of writing into blocks reused since.

Several prefill workers may hold a lease on one reservation at once (a redelivery while the first
is slow): their writes are idempotent (full prompt blocks, identical bytes). A reservation whose
every lease lapsed without its KV is ``lapsed``: its holder died or hangs, and the decode worker
prefills it locally. Pure: time only comes in as ``now`` (epoch seconds, both workers' clocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

CLOCK_MARGIN_S = 0.5  # between the two workers' clocks, and a renewal's round trip


def may_start_write(expires_at: float | None, now: float, write_timeout_s: float) -> bool:
    """Whether a write of at most ``write_timeout_s`` started at ``now`` ends before the lease does."""
    return expires_at is not None and now + write_timeout_s + CLOCK_MARGIN_S < expires_at


@dataclass
class _Reservation:
    holders: dict[str, float] = field(default_factory=dict)  # prefill worker id → lease expiry
    is_closed: bool = False

    def expires_at(self) -> float | None:
        return max(self.holders.values(), default=None)


class ReservationLeases:
    """The decode worker's side: per reservation (transfer id), who holds a lease until when."""

    def __init__(self, lease_s: float) -> None:
        assert lease_s > CLOCK_MARGIN_S, f"lease of {lease_s}s is no longer than the clock margin"
        self.lease_s = lease_s
        self._reservations: dict[str, _Reservation] = {}

    def open(self, transfer_id: str) -> None:
        """A reservation waits for its KV: leases on it may be granted."""
        self._reservations[transfer_id] = _Reservation()

    def grant(self, transfer_id: str, prefill_worker_id: str, now: float) -> float | None:
        """A lease (or its renewal) until the returned time; None: refused (closed or unknown)."""
        reservation = self._reservations.get(transfer_id)
        if reservation is None or reservation.is_closed:
            return None
        expires_at = now + self.lease_s
        reservation.holders[prefill_worker_id] = expires_at
        return expires_at

    def lapsed(self, now: float) -> list[str]:
        """Open reservations that had leases, none of them still valid: their holders are gone."""
        return [t for t, r in self._reservations.items()
                if not r.is_closed and r.holders and r.expires_at() <= now]

    def unclaimed(self) -> list[str]:
        """Open reservations no prefill worker has leased yet (still on the queue, or taken by one
        that has not asked)."""
        return [t for t, r in self._reservations.items() if not r.is_closed and not r.holders]

    def close(self, transfer_id: str) -> float | None:
        """Grant no more leases on ``transfer_id`` and forget it; returns when the last lease granted
        expires (no write can land after it), None if none was granted."""
        reservation = self._reservations.pop(transfer_id, None)
        if reservation is None:
            return None
        reservation.is_closed = True
        return reservation.expires_at()

    @property
    def num_open(self) -> int:
        return len(self._reservations)


class PrefillLease:
    """The prefill worker's side of one lease: the latest grant, and when to renew it."""

    def __init__(self) -> None:
        self.expires_at: float | None = None
        self.lease_s = 0.0
        self.is_refused = False

    def granted(self, expires_at: float | None, lease_s: float) -> None:
        """A reply to a claim or renewal: None is a refusal, final (the decode worker moved on)."""
        if expires_at is None:
            self.is_refused = True
        elif not self.is_refused:
            self.expires_at = max(expires_at, self.expires_at or expires_at)
            self.lease_s = lease_s

    def renew_in_s(self, now: float) -> float:
        """Renew when two thirds of the lease are left, so a lost renewal still leaves a second try."""
        if self.expires_at is None:
            return 0.0
        return max(0.0, self.expires_at - now - 2 * self.lease_s / 3)

    def may_start_write(self, now: float, write_timeout_s: float) -> bool:
        return not self.is_refused and may_start_write(self.expires_at, now, write_timeout_s)
