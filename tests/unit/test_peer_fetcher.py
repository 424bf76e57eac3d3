"""A draining decode worker gives back the blocks of failed prefix fetches before its poll loop
stops: once no late write can land in them, and not before."""

from __future__ import annotations

import time

from services.decode.fetch import PeerFetcher
from shared.protocol import Subjects


class RecordingEngine:
    def __init__(self) -> None:
        self.finished: list[tuple[str, int, float]] = []

    def finish_prefix_fetch(self, fetch_id: str, num_blocks: int) -> None:
        self.finished.append((fetch_id, num_blocks, time.time()))


def fetcher(engine: RecordingEngine) -> PeerFetcher:
    return PeerFetcher(engine=engine, transfer=None, store=None, bus=None, subjects=Subjects("t"),
                       worker_id="w1", model="m", write_timeout_s=1.0, window_s=1.0)


async def test_release_waits_for_the_last_write_deadline_then_frees_every_failed_fetch():
    engine = RecordingEngine()
    f = fetcher(engine)
    now = time.time()
    f.fetches.quarantine("late", now + 0.3)
    f.fetches.quarantine("past", now - 1.0)
    f.tick(now)  # what the poll loop does: only the one whose writes can no longer land
    assert [(i, n) for i, n, _ in engine.finished] == [("past", 0)]
    await f.release_quarantine()
    assert [(i, n) for i, n, _ in engine.finished] == [("past", 0), ("late", 0)]
    assert engine.finished[-1][2] >= now + 0.3   # not before its deadline
    assert f.fetches.num_quarantined == 0


async def test_release_with_nothing_quarantined_frees_nothing():
    engine = RecordingEngine()
    await fetcher(engine).release_quarantine()
    assert engine.finished == []
