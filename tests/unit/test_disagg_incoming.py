"""The owner of a decode worker's incoming KV writes (shared.disagg.incoming) with a fake clock:
what a notification resolves, when a wait ends without one, and when held blocks go back."""

from __future__ import annotations

from shared.disagg.incoming import Delivery, IncomingWrites
from shared.protocol import PrefillNotification

NOW = 1_000_000.0


def note(transfer_id: str, status: str = "ok") -> bytes:
    return PrefillNotification(transfer_id=transfer_id, request_id="r-" + transfer_id, status=status,
                               num_blocks=2).to_bytes()


def make() -> tuple[IncomingWrites, list[str]]:
    released: list[str] = []
    return IncomingWrites(release=released.append), released


async def test_the_first_notification_resolves_its_wait_and_later_ones_are_repeats():
    incoming, _ = make()
    a, b = incoming.expect("a", "r-a"), incoming.expect("b", "r-b")
    delivery, got = incoming.deliver(note("a"), received_at=5.0)
    assert delivery is Delivery.TAKEN and a.result() == got and got.transfer_id == "a"
    assert not b.done() and incoming.is_waiting("b") and not incoming.is_waiting("a")
    assert incoming.deliver(note("a", "failed"))[0] is Delivery.REPEATED
    assert a.result().status == "ok"  # not overridden
    assert incoming.forget("a").received_at == 5.0
    assert incoming.deliver(note("a"))[0] is Delivery.UNKNOWN  # forgotten
    assert incoming.deliver(note("zzz"))[0] is Delivery.UNKNOWN
    assert incoming.deliver(b"\x00not json") == (Delivery.MALFORMED, None)
    assert incoming.has_waiting  # b


async def test_end_wait_resolves_with_none_once():
    incoming, _ = make()
    a = incoming.expect("a", "r-a")
    assert incoming.end_wait("a").request_id == "r-a"
    assert a.result() is None
    assert incoming.end_wait("a") is None and incoming.end_wait("nobody") is None
    assert incoming.deliver(note("a"))[0] is Delivery.REPEATED and a.result() is None


async def test_tick_ends_the_waits_past_their_time_only():
    incoming, _ = make()
    soon = incoming.expect("soon", "r-soon", wait_until=NOW + 1)
    never = incoming.expect("never", "r-never")  # no time limit: only a notification or end_wait
    assert incoming.tick(NOW + 0.999) == [] and not soon.done()
    assert [e.transfer_id for e in incoming.tick(NOW + 1)] == ["soon"]
    assert soon.result() is None and not never.done()
    assert incoming.tick(NOW + 1e9) == []  # ended once
    assert not never.done()


async def test_held_blocks_go_back_at_their_time_in_order_and_once():
    incoming, released = make()
    assert incoming.held_until is None
    incoming.hold("late", NOW + 3)
    incoming.hold("early", NOW + 1)
    incoming.hold("mid", NOW + 2)
    assert incoming.held_until == NOW + 3 and incoming.num_held == 3
    incoming.tick(NOW + 0.5)
    assert released == []
    incoming.tick(NOW + 2)
    assert released == ["early", "mid"]
    incoming.tick(NOW + 3)
    incoming.tick(NOW + 4)
    assert released == ["early", "mid", "late"] and incoming.num_held == 0 and incoming.held_until is None
