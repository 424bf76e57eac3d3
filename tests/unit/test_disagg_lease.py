"""Leases on remote-prefill reservations (shared.disagg.lease) with a fake clock: when a decode
worker grants, when a reservation counts as lapsed, when its blocks are safe to reuse, and when a
prefill worker may start a write and renew."""

from __future__ import annotations

import pytest

from shared.disagg.lease import CLOCK_MARGIN_S, PrefillLease, ReservationLeases, may_start_write

NOW = 1_000_000.0
LEASE_S, WRITE_S = 4.0, 2.0


def test_a_lease_is_granted_while_open_and_refused_once_closed():
    leases = ReservationLeases(LEASE_S)
    assert leases.grant("t1", "p1", NOW) is None  # unknown reservation
    leases.open("t1")
    assert leases.grant("t1", "p1", NOW) == NOW + LEASE_S
    assert leases.grant("t1", "p1", NOW + 1) == NOW + 1 + LEASE_S  # a renewal moves it on
    assert leases.close("t1") == NOW + 1 + LEASE_S  # the blocks are safe from then on
    assert leases.grant("t1", "p1", NOW + 2) is None and leases.num_open == 0


def test_closing_an_unclaimed_reservation_leaves_nothing_to_wait_for():
    leases = ReservationLeases(LEASE_S)
    leases.open("t1")
    assert leases.close("t1") is None and leases.close("t1") is None


def test_lapsed_once_every_holder_expired_never_before_a_claim():
    leases = ReservationLeases(LEASE_S)
    leases.open("t1")
    leases.open("t2")
    assert leases.lapsed(NOW + 100) == []  # no claim yet: the queue may still hand it out
    leases.grant("t1", "p1", NOW)
    leases.grant("t1", "p2", NOW + 2)
    assert leases.lapsed(NOW + LEASE_S) == []  # p2 still holds one
    assert leases.lapsed(NOW + 2 + LEASE_S) == ["t1"]
    leases.close("t1")
    assert leases.lapsed(NOW + 100) == []


def test_unclaimed_are_the_open_reservations_nobody_leased_yet():
    leases = ReservationLeases(LEASE_S)
    for t in ("t1", "t2", "t3"):
        leases.open(t)
    leases.grant("t2", "p1", NOW)
    leases.close("t3")
    assert leases.unclaimed() == ["t1"]
    leases.grant("t1", "p1", NOW)
    assert leases.unclaimed() == []


def test_a_write_starts_only_while_the_lease_outlasts_it():
    expires = NOW + LEASE_S
    assert may_start_write(expires, NOW, WRITE_S)
    assert not may_start_write(expires, expires - WRITE_S - CLOCK_MARGIN_S, WRITE_S)
    assert not may_start_write(None, NOW, WRITE_S)


def test_the_prefill_side_renews_early_and_a_refusal_is_final():
    lease = PrefillLease()
    assert lease.renew_in_s(NOW) == 0.0 and not lease.may_start_write(NOW, WRITE_S)
    lease.granted(NOW + LEASE_S, LEASE_S)
    assert lease.renew_in_s(NOW) == pytest.approx(LEASE_S / 3)
    assert lease.may_start_write(NOW, WRITE_S)
    lease.granted(NOW + 1, LEASE_S)  # a reply that arrived out of order never shortens it
    assert lease.expires_at == NOW + LEASE_S
    lease.granted(None, LEASE_S)
    assert lease.is_refused and not lease.may_start_write(NOW, WRITE_S)
    lease.granted(NOW + 10, LEASE_S)
    assert lease.is_refused and not lease.may_start_write(NOW, WRITE_S)


def test_a_lease_no_longer_than_the_margin_is_refused_at_construction():
    with pytest.raises(AssertionError, match="clock margin"):
        ReservationLeases(CLOCK_MARGIN_S)
