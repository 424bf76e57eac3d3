"""Cross-worker prefix fetch: a decode worker's bookkeeping for both sides, the pure core that
``services.decode.fetch`` drives (it asks the engine, the holder and NIXL; this decides).

Asking side: ``ask`` decides with ``shared.policy.kv_fetch.decide_fetch`` whether fetching the
missing blocks beats computing them (with the bandwidth the last fetch measured) and forms the
``KvFetchRequest``; ``expect`` waits for its notification (``shared.disagg.incoming``, as remote
prefill does); ``judge`` reads the holder's answer and the notification; ``settle`` gives the
blocks back at once when no write into them can land any more, otherwise quarantines them until
``write_deadline + write_timeout_s`` and the clock margin (``tick`` then gives them back).
Lending side: ``refusal`` says why an ask is not served, ``lent_block_ids`` which blocks go.

Time only comes in as ``now`` (epoch seconds, the holder's clock too).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.disagg.incoming import Delivery, IncomingWrites
from shared.disagg.lease import CLOCK_MARGIN_S
from shared.policy.kv_fetch import FetchConfig, FetchDecision, decide_fetch
from shared.protocol import KvFetchRequest, KvFetchResult, PrefillNotification

if TYPE_CHECKING:
    from shared.engine.reservations import PrefixFetchSlot


@dataclass
class FetchCounters:
    num_fetches: int = 0  # fetches that brought blocks
    num_blocks_fetched: int = 0
    num_failed: int = 0  # asked, got nothing: computed instead
    num_skipped: int = 0  # a hint not taken (cheaper to compute, pool full, nothing missing)
    num_lent: int = 0  # fetches served for other workers
    num_blocks_lent: int = 0


class BandwidthEstimate:
    """The transfer bandwidth the latest completed fetch measured: its bytes over its time less the
    fixed round trip. None until one completed (``decide_fetch`` then assumes a default)."""

    def __init__(self, round_trip_s: float) -> None:
        self.round_trip_s = round_trip_s
        self.bytes_per_s: float | None = None

    def observe(self, num_bytes: int, elapsed_s: float) -> None:
        self.bytes_per_s = num_bytes / max(elapsed_s - self.round_trip_s, 1e-4)


@dataclass(frozen=True)
class FetchOutcome:
    num_blocks: int  # written and notified: they may join the prefix cache
    is_settled: bool  # no write into the fetch's blocks can land any more
    problem: str = ""  # why nothing came ("" when blocks came)
    is_refusal: bool = False  # the holder said no (an ordinary outcome, not a fault)


def judge(result: KvFetchResult, note: PrefillNotification | None) -> FetchOutcome:
    """The holder's answer and the notification that followed its write (None: none came in time)."""
    if not result.num_blocks:
        return FetchOutcome(0, not result.write_failed, f"lent no KV blocks ({result.message})", is_refusal=True)
    if note is None:
        return FetchOutcome(0, False, f"wrote {result.num_blocks} KV blocks but no notification came")
    if note.status != "ok" or note.num_blocks != result.num_blocks:
        return FetchOutcome(0, True, f"sent a notification ({note.status}, {note.num_blocks} blocks) that does "
                                     f"not match its answer ({result.num_blocks} blocks)")
    return FetchOutcome(result.num_blocks, True)


def answer_timeout_s(ask: KvFetchRequest, now: float) -> float:
    """How long to wait for the holder's answer: until its last write could have ended."""
    return ask.write_deadline - now + ask.write_timeout_s + CLOCK_MARGIN_S


def refusal(ask: KvFetchRequest, model: str, now: float) -> str | None:
    """Why the holder does not serve ``ask`` at ``now``; None: it tries."""
    if ask.model != model:
        return f"model {ask.model!r} is not this worker's {model!r}"
    if now > ask.write_deadline:
        return "asked too late (past its write deadline)"
    return None


def lent_block_ids(ask: KvFetchRequest, pinned: list[int]) -> list[int]:
    """Of the leading run pinned here, the blocks the asker lacks (as many as it holds room for)."""
    return pinned[ask.first_block:][:len(ask.block_ids)]


class PeerFetches:
    def __init__(self, *, worker_id: str, model: str, finish: Callable[[str, int], None], write_timeout_s: float,
                 window_s: float, config: FetchConfig = FetchConfig()) -> None:
        self.worker_id = worker_id
        self.model = model
        self.write_timeout_s = write_timeout_s
        self.window_s = window_s  # the holder must start its write within this
        self.config = config
        self.counters = FetchCounters()
        self.bandwidth = BandwidthEstimate(config.round_trip_s)
        self._finish = finish  # ends a fetch in the engine: (fetch id, blocks written)
        self._incoming = IncomingWrites(release=lambda fetch_id: finish(fetch_id, 0))

    # -- asking side --------------------------------------------------------------------------------
    def ask(self, fetch_id: str, request_id: str, slot: PrefixFetchSlot | None, *, now: float, block_size: int,
            block_bytes: int, prefill_tokens_per_s: float | None) -> tuple[KvFetchRequest | None, str]:
        """The ask to send for the blocks ``slot`` holds, and why; None: compute them (the slot, if
        any, is ended)."""
        if slot is None or not slot.block_ids:
            self.counters.num_skipped += 1
            return None, "nothing to fetch into"
        decision: FetchDecision = decide_fetch(len(slot.block_ids), block_size, block_bytes, prefill_tokens_per_s,
                                               self.bandwidth.bytes_per_s, self.config)
        if not decision.fetch:
            self._finish(fetch_id, 0)
            self.counters.num_skipped += 1
            return None, decision.reason
        return KvFetchRequest(fetch_id=fetch_id, request_id=request_id, model=self.model,
                              decode_worker_id=self.worker_id, block_hashes=slot.block_hashes,
                              first_block=slot.num_local, block_ids=slot.block_ids,
                              write_deadline=now + self.window_s, write_timeout_s=self.write_timeout_s), decision.reason

    def expect(self, ask: KvFetchRequest) -> asyncio.Future[PrefillNotification | None]:
        """Wait for the notification of the holder's write (sent before its answer may arrive)."""
        return self._incoming.expect(ask.fetch_id, ask.request_id)

    def forget(self, ask: KvFetchRequest) -> None:
        self._incoming.forget(ask.fetch_id)

    def settle(self, ask: KvFetchRequest, num_written: int, is_settled: bool) -> None:
        """The fetch is over: its blocks go back now (the written ones into the prefix cache) if no
        write into them can land any more, else once none can."""
        if is_settled:
            self._finish(ask.fetch_id, num_written)
        else:
            self.quarantine(ask.fetch_id, ask.write_deadline + ask.write_timeout_s + CLOCK_MARGIN_S)

    def quarantine(self, fetch_id: str, until: float) -> None:
        self._incoming.hold(fetch_id, until)

    def record(self, num_written: int, elapsed_s: float, block_bytes: int) -> None:
        """A fetch that brought ``num_written`` blocks in ``elapsed_s`` (0 blocks: it failed)."""
        if not num_written:
            self.counters.num_failed += 1
            return
        self.bandwidth.observe(num_written * block_bytes, elapsed_s)
        self.counters.num_fetches += 1
        self.counters.num_blocks_fetched += num_written

    # -- as a receiver of KV notifications ----------------------------------------------------------
    def deliver(self, message: bytes) -> bool:
        """True if the notification names a fetch of ours (consumed), else False."""
        delivery, _ = self._incoming.deliver(message)
        return delivery in (Delivery.TAKEN, Delivery.REPEATED)

    @property
    def has_waiting(self) -> bool:
        return self._incoming.has_waiting

    def tick(self, now: float) -> None:
        """Give back the blocks of failed fetches once no write into them can still land."""
        self._incoming.tick(now)

    @property
    def quarantined_until(self) -> float | None:
        """When the last quarantined blocks may go back; None: none are."""
        return self._incoming.held_until

    @property
    def num_quarantined(self) -> int:
        return self._incoming.num_held

    # -- lending side -------------------------------------------------------------------------------
    def lent(self, num_blocks: int) -> None:
        self.counters.num_lent += 1
        self.counters.num_blocks_lent += num_blocks
