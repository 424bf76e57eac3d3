"""Cross-worker prefix reuse: a decode worker fetches a prompt's cached prefix over NIXL from the
worker that holds it, instead of recomputing it, and lends its own cached blocks to others.

Asking side (B). Admission names a worker holding more of the prompt's leading blocks
(``GenerateRequest.kv_source``, see ``shared.policy.kv_fetch``). If fetching the missing blocks
is cheaper than computing them, B holds blocks for them (its own cached run adopted, fresh blocks
for the rest) and asks the holder A on ``<ns>.v1.decode.<A>.kv-fetch``. A pins the run it holds
(blocks on its disk read and host-memory blocks copied into its pool first), writes it with one NIXL WRITE into B's fresh
blocks, and answers with the number of blocks written once the write completed. B counts them
as filled only after the NIXL notification naming the fetch (the rule of every KV write here),
then registers them in its prefix cache; the request then goes on as usual and finds them there.
Anything else (no answer, an error, a refusal, a short run, no notification) falls back to
computing what is missing: the request never fails because of a fetch.

Block safety: A starts no write after the ask's ``write_deadline`` and none lasts past
``write_timeout_s``. B gives blocks back at once when A answered (the write is over either way),
otherwise only after ``write_deadline + write_timeout_s`` and the clock margin, so a late write
can never land in blocks another request reuses.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
import uuid
from dataclasses import dataclass

from pydantic import ValidationError

from shared.bus import Bus, ServiceError
from shared.disagg.lease import CLOCK_MARGIN_S
from shared.engine import AsyncEngine
from shared.policy.kv_fetch import FetchConfig, decide_fetch
from shared.protocol import GenerateRequest, KvFetchRequest, KvFetchResult, PrefillNotification, Subjects
from shared.telemetry import tracing
from shared.transfer import KvTransfer, KVTransferFailed, MetadataStore, connect_peer, wait_written

log = logging.getLogger(__name__)


@dataclass
class FetchCounters:
    num_fetches: int = 0  # fetches that brought blocks
    num_blocks_fetched: int = 0
    num_failed: int = 0  # asked, got nothing: computed instead
    num_skipped: int = 0  # a hint not taken (cheaper to compute, pool full, nothing missing)
    num_lent: int = 0  # fetches served for other workers
    num_blocks_lent: int = 0


class PeerFetcher:
    def __init__(self, *, engine: AsyncEngine, transfer: KvTransfer, store: MetadataStore, bus: Bus,
                 subjects: Subjects, worker_id: str, model: str, write_timeout_s: float, window_s: float,
                 config: FetchConfig = FetchConfig()) -> None:
        self.transfer = transfer
        self.counters = FetchCounters()
        self._engine = engine
        self._store = store
        self._bus = bus
        self._subjects = subjects
        self.worker_id = worker_id
        self.model = model
        self.write_timeout_s = write_timeout_s
        self.window_s = window_s  # the holder must start its write within this
        self.config = config
        self._waiting: dict[str, asyncio.Future[PrefillNotification]] = {}
        self._quarantine: list[tuple[float, str]] = []  # (epoch seconds, fetch id): blocks a late write may hit
        self._bytes_per_s: float | None = None  # measured by completed fetches

    # -- asking side --------------------------------------------------------------------------------
    async def fetch(self, request: GenerateRequest) -> int:
        """Bring the prompt's prefix from ``request.kv_source`` into the prefix cache if that pays;
        returns the number of blocks fetched (0: the request computes what it lacks)."""
        source = request.kv_source
        if source is None or source.worker_id == self.worker_id or request.is_text:
            return 0
        engine, fetch_id = self._engine, uuid.uuid4().hex
        prompt = request.prompt_token_ids
        try:
            slot = await engine.call(lambda e: e.reserve_prefix_fetch(fetch_id, prompt, source.num_blocks))
        except BaseException:  # cancelled meanwhile: undo whatever the engine thread reserved
            engine.finish_prefix_fetch(fetch_id, 0)
            raise
        if slot is None or not slot.block_ids:
            self.counters.num_skipped += 1
            return 0
        spec = engine.engine.kv_spec
        decision = decide_fetch(len(slot.block_ids), spec.block_size, spec.bytes_per_block,
                                engine.stats().prefill_tokens_per_s, self._bytes_per_s, self.config)
        if not decision.fetch:
            log.debug("%s: not fetching from %s: %s", request.request_id, source.worker_id, decision.reason)
            engine.finish_prefix_fetch(fetch_id, 0)
            self.counters.num_skipped += 1
            return 0
        ask = KvFetchRequest(fetch_id=fetch_id, request_id=request.request_id, model=self.model,
                             decode_worker_id=self.worker_id, block_hashes=slot.block_hashes,
                             first_block=slot.num_local, block_ids=slot.block_ids,
                             write_deadline=time.time() + self.window_s, write_timeout_s=self.write_timeout_s)
        started = time.monotonic()
        num_written, settled = 0, False
        try:
            with tracing.child_span("kv.fetch", holder=source.worker_id, num_blocks=len(slot.block_ids)):
                num_written, settled = await self._ask(source.worker_id, ask)
        finally:  # also when the request is cancelled meanwhile
            if settled:
                engine.finish_prefix_fetch(fetch_id, num_written)
            else:  # the holder may still write: keep the blocks until it no longer can
                heapq.heappush(self._quarantine, (ask.write_deadline + ask.write_timeout_s + CLOCK_MARGIN_S,
                                                  fetch_id))
        if not num_written:
            self.counters.num_failed += 1
            return 0
        elapsed = time.monotonic() - started
        self._bytes_per_s = num_written * spec.bytes_per_block / max(elapsed - self.config.round_trip_s, 1e-4)
        self.counters.num_fetches += 1
        self.counters.num_blocks_fetched += num_written
        log.info("%s: fetched %d KV blocks from %s in %.1f ms (%d cached here; %s)", request.request_id,
                 num_written, source.worker_id, elapsed * 1e3, slot.num_local, decision.reason)
        return num_written

    async def _ask(self, holder: str, ask: KvFetchRequest) -> tuple[int, bool]:
        """(blocks written and notified, whether no write into the blocks can still land)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[ask.fetch_id] = future
        rid = ask.request_id
        try:
            timeout_s = ask.write_deadline - time.time() + ask.write_timeout_s + CLOCK_MARGIN_S
            try:
                result = await self._bus.request(self._subjects.kv_fetch(holder), ask, timeout_s=timeout_s)
            except ServiceError as exc:
                log.warning("%s: KV fetch from %s failed (%s): computing the prefix here", rid, holder, exc.message)
                return 0, False
            if not result.num_blocks:
                log.info("%s: %s lent no KV blocks (%s): computing the prefix here", rid, holder, result.message)
                return 0, not result.write_failed
            try:
                note = await asyncio.wait_for(future, timeout=max(ask.write_timeout_s, 0.1))
            except asyncio.TimeoutError:
                log.warning("%s: %s wrote %d KV blocks but no notification came: computing the prefix here", rid,
                            holder, result.num_blocks)
                return 0, False
            if note.status != "ok" or note.num_blocks != result.num_blocks:
                log.warning("%s: %s's notification (%s, %d blocks) does not match its answer (%d blocks): "
                            "computing the prefix here", rid, holder, note.status, note.num_blocks, result.num_blocks)
                return 0, True
            return result.num_blocks, True
        finally:
            self._waiting.pop(ask.fetch_id, None)

    def deliver(self, message: bytes, num_bytes: int = 0, received_at: float = 0.0) -> bool:
        """A NIXL notification: True if it names a fetch of ours (consumed), else False."""
        try:
            note = PrefillNotification.from_bytes(message)
        except ValidationError:
            return False
        future = self._waiting.get(note.transfer_id)
        if future is None:
            return False
        if not future.done():
            future.set_result(note)
        return True

    @property
    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def tick(self, now: float) -> None:
        """Give back the blocks of failed fetches once no write into them can still land."""
        while self._quarantine and self._quarantine[0][0] <= now:
            self._engine.finish_prefix_fetch(heapq.heappop(self._quarantine)[1], 0)

    async def release_quarantine(self) -> None:
        """Wait until no late write can land in any failed fetch's blocks, then give them back: a
        draining worker calls this before its poll loop (whose ticks would do it) stops, so that
        a role flip right after a failed fetch does not keep those blocks out of the pool."""
        if self._quarantine:
            ends_at = max(at for at, _ in self._quarantine)
            log.info("waiting %.1fs for %d failed fetches' blocks to be safe to reuse",
                     max(0.0, ends_at - time.time()), len(self._quarantine))
            await asyncio.sleep(max(0.0, ends_at - time.time()))
            self.tick(ends_at)

    # -- holder side --------------------------------------------------------------------------------
    async def _pin(self, ask: KvFetchRequest) -> list[int]:
        """Pin the leading run of the asked chain held here: blocks in host memory are copied into
        the pool, blocks on disk are read first (while the ask's write deadline allows)."""
        hashes, engine = ask.block_hashes, self._engine
        while (await engine.call(lambda e: e.read_prefix_from_disk(hashes))) and time.time() < ask.write_deadline:
            await asyncio.sleep(0.005)
        return await engine.call(lambda e: e.lend_prefix(ask.fetch_id, hashes))

    async def lend(self, ask: KvFetchRequest) -> KvFetchResult:
        """Write the cached blocks another worker asks for into its pool; answer once written."""
        def refused(why: str, write_failed: bool = False) -> KvFetchResult:
            log.info("%s: lent no KV blocks to %s: %s", ask.request_id, ask.decode_worker_id, why)
            return KvFetchResult(fetch_id=ask.fetch_id, message=why, write_failed=write_failed)

        if ask.model != self.model:
            return refused(f"model {ask.model!r} is not this worker's {self.model!r}")
        if time.time() > ask.write_deadline:
            return refused("asked too late (past its write deadline)")
        try:
            peer = await connect_peer(self._store, ask.decode_worker_id, self.transfer)
        except KVTransferFailed as exc:
            return refused(f"cannot reach it: {exc}")
        engine = self._engine
        try:
            block_ids = await self._pin(ask)
            local = block_ids[ask.first_block:][:len(ask.block_ids)]
            if not local:
                return refused(f"holds {len(block_ids)} of the {len(ask.block_hashes)} leading blocks now")
            if time.time() > ask.write_deadline:
                return refused("past its write deadline before the blocks were pinned")
            note = PrefillNotification(transfer_id=ask.fetch_id, request_id=ask.request_id, num_blocks=len(local),
                                       prefill_worker_id=self.worker_id)
            try:
                handle = self.transfer.write_blocks(peer, local, ask.block_ids[:len(local)], note.to_bytes())
                await wait_written(self.transfer, handle, ask.write_timeout_s)
            except KVTransferFailed as exc:
                self.transfer.remove_peer(peer)  # reconnect from fresh metadata next time
                return refused(f"the write failed: {exc}", write_failed=True)
        finally:  # queued behind the lend even if this handler was cancelled while it waited
            engine.return_prefix(ask.fetch_id)
        self.counters.num_lent += 1
        self.counters.num_blocks_lent += len(local)
        log.info("%s: lent %d KV blocks to %s", ask.request_id, len(local), ask.decode_worker_id)
        return KvFetchResult(fetch_id=ask.fetch_id, num_blocks=len(local))
