"""Peer fetch's decisions and bookkeeping (shared.disagg.peer_fetch) with a fake clock and a
recording engine: whether to ask, what the ask says, how an answer is judged, when the blocks of
a failed fetch go back, and the bandwidth the next decision uses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shared.disagg.lease import CLOCK_MARGIN_S
from shared.disagg.peer_fetch import (BandwidthEstimate, FetchOutcome, PeerFetches, answer_timeout_s, judge,
                                      lent_block_ids, refusal)
from shared.policy.kv_fetch import FetchConfig
from shared.protocol import KvFetchResult, PrefillNotification

NOW = 1_000_000.0
BLOCK, BLOCK_BYTES = 16, 1 << 20
WRITE_TIMEOUT_S, WINDOW_S = 2.0, 1.0


def make(config: FetchConfig = FetchConfig()) -> tuple[PeerFetches, list[tuple[str, int]]]:
    finished: list[tuple[str, int]] = []
    fetches = PeerFetches(worker_id="b", model="m", finish=lambda fid, n: finished.append((fid, n)),
                          write_timeout_s=WRITE_TIMEOUT_S, window_s=WINDOW_S, config=config)
    return fetches, finished


def slot(num_fresh: int, num_local: int = 1):
    return SimpleNamespace(block_hashes=list(range(num_local + num_fresh)), num_local=num_local,
                           block_ids=[50 + i for i in range(num_fresh)])


def ask(fetches, fid="f1", s=None, *, rate: float | None = None):
    return fetches.ask(fid, "r1", slot(4) if s is None else s, now=NOW, block_size=BLOCK, block_bytes=BLOCK_BYTES,
                       prefill_tokens_per_s=rate)


def test_the_ask_names_the_fresh_blocks_and_the_write_window():
    fetches, finished = make()
    got, reason = ask(fetches)
    assert "fetch 4 blocks" in reason
    assert (got.fetch_id, got.request_id, got.model, got.decode_worker_id) == ("f1", "r1", "m", "b")
    assert got.first_block == 1 and got.block_ids == [50, 51, 52, 53] and got.block_hashes == [0, 1, 2, 3, 4]
    assert got.write_deadline == NOW + WINDOW_S and got.write_timeout_s == WRITE_TIMEOUT_S
    assert answer_timeout_s(got, NOW) == WINDOW_S + WRITE_TIMEOUT_S + CLOCK_MARGIN_S
    assert finished == [] and fetches.counters.num_skipped == 0


@pytest.mark.parametrize("case", ["no slot", "no fresh blocks", "too few blocks", "cheaper to compute"])
def test_a_fetch_not_worth_it_is_skipped(case):
    fetches, finished = make()
    s = {"no slot": None, "no fresh blocks": slot(0), "too few blocks": slot(1)}.get(case, slot(4))
    got, _ = fetches.ask("f1", "r1", s, now=NOW, block_size=BLOCK, block_bytes=BLOCK_BYTES,
                         prefill_tokens_per_s=1e9 if case == "cheaper to compute" else None)
    assert got is None and fetches.counters.num_skipped == 1
    # a slot with blocks is ended at once; no slot (or an empty one) holds nothing
    assert finished == ([("f1", 0)] if case in ("too few blocks", "cheaper to compute") else [])


def test_the_measured_bandwidth_steers_the_next_decision():
    fetches, _ = make(FetchConfig(round_trip_s=0.01))
    rate = 4 * BLOCK / 0.05  # computing 4 blocks takes 50 ms
    assert ask(fetches, rate=rate)[0] is not None  # the default 1 GB/s: 4 MiB in ~14 ms
    fetches.record(4, 0.01 + 0.2, BLOCK_BYTES)  # measured: 4 MiB in 200 ms beyond the round trip
    assert fetches.bandwidth.bytes_per_s == pytest.approx(4 * BLOCK_BYTES / 0.2)
    assert ask(fetches, "f2", rate=rate)[0] is None
    assert (fetches.counters.num_fetches, fetches.counters.num_blocks_fetched) == (1, 4)
    fetches.record(0, 5.0, BLOCK_BYTES)  # a failed fetch measures nothing
    assert fetches.counters.num_failed == 1
    assert fetches.bandwidth.bytes_per_s == pytest.approx(4 * BLOCK_BYTES / 0.2)


def test_a_bandwidth_estimate_never_divides_by_zero():
    estimate = BandwidthEstimate(round_trip_s=0.01)
    assert estimate.bytes_per_s is None
    estimate.observe(1000, 0.005)  # faster than the round trip itself
    assert estimate.bytes_per_s == 1000 / 1e-4


def test_a_settled_fetch_ends_at_once_and_an_unsettled_one_waits_out_the_write_window():
    fetches, finished = make()
    done, failed = ask(fetches, "done")[0], ask(fetches, "failed")[0]
    fetches.settle(done, 4, is_settled=True)
    assert finished == [("done", 4)]
    fetches.settle(failed, 0, is_settled=False)
    safe_at = failed.write_deadline + failed.write_timeout_s + CLOCK_MARGIN_S
    assert fetches.quarantined_until == safe_at and fetches.num_quarantined == 1
    fetches.tick(safe_at - 0.001)
    assert finished == [("done", 4)]
    fetches.tick(safe_at)
    assert finished == [("done", 4), ("failed", 0)] and fetches.num_quarantined == 0


def result(num_blocks=4, **kw) -> KvFetchResult:
    return KvFetchResult(fetch_id="f1", num_blocks=num_blocks, **kw)


def note(num_blocks=4, status="ok") -> PrefillNotification:
    return PrefillNotification(transfer_id="f1", request_id="r1", num_blocks=num_blocks, status=status)


@pytest.mark.parametrize("answer, notification, expected", [
    (result(), note(), FetchOutcome(4, True)),
    (result(0, message="busy"), None, FetchOutcome(0, True, "lent no KV blocks (busy)", is_refusal=True)),
    (result(0, message="x", write_failed=True), None, FetchOutcome(0, False, "lent no KV blocks (x)", is_refusal=True)),
    (result(), None, FetchOutcome(0, False, "wrote 4 KV blocks but no notification came")),
])
def test_judging_the_answer(answer, notification, expected):
    assert judge(answer, notification) == expected


@pytest.mark.parametrize("notification", [note(3), note(status="failed")])
def test_a_notification_that_contradicts_the_answer_brings_nothing_but_settles(notification):
    outcome = judge(result(), notification)
    assert (outcome.num_blocks, outcome.is_settled) == (0, True) and "does not match" in outcome.problem


async def test_only_notifications_of_its_own_fetches_are_taken():
    fetches, _ = make()
    asked = ask(fetches)[0]
    future = fetches.expect(asked)
    assert fetches.has_waiting
    assert not fetches.deliver(PrefillNotification(transfer_id="other", request_id="x").to_bytes())
    assert not fetches.deliver(b"garbage")
    assert fetches.deliver(note().to_bytes()) and future.result().num_blocks == 4
    assert fetches.deliver(note().to_bytes())  # a repeat is still ours
    fetches.forget(asked)
    assert not fetches.has_waiting and not fetches.deliver(note().to_bytes())


def test_the_lender_refuses_another_model_and_a_late_ask_and_lends_what_the_asker_lacks():
    fetches, _ = make()
    asked = ask(fetches)[0]  # first_block 1, room for 4 blocks
    assert refusal(asked, "m", NOW) is None
    assert "not this worker's 'other'" in refusal(asked, "other", NOW)
    assert "too late" in refusal(asked, "m", asked.write_deadline + 0.001)
    assert lent_block_ids(asked, [9, 10, 11]) == [10, 11]
    assert lent_block_ids(asked, [9, 10, 11, 12, 13, 14, 15]) == [10, 11, 12, 13]
    assert lent_block_ids(asked, [9]) == []
    fetches.lent(2)
    assert (fetches.counters.num_lent, fetches.counters.num_blocks_lent) == (1, 2)
