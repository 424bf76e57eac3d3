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

The decisions and the bookkeeping are ``shared.disagg.peer_fetch.PeerFetches``; this module asks
the engine, the holder and NIXL.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from shared.bus import Bus, ServiceError
from shared.disagg.peer_fetch import FetchOutcome, PeerFetches, answer_timeout_s, judge, lent_block_ids, refusal
from shared.engine import AsyncEngine
from shared.policy.kv_fetch import FetchConfig
from shared.protocol import GenerateRequest, KvFetchRequest, KvFetchResult, PrefillNotification, Subjects
from shared.telemetry import tracing
from shared.transfer import KvTransfer, KVTransferFailed, MetadataStore, connect_peer, write_and_wait

log = logging.getLogger(__name__)


class PeerFetcher:
    def __init__(self, *, engine: AsyncEngine, transfer: KvTransfer, store: MetadataStore, bus: Bus,
                 subjects: Subjects, worker_id: str, model: str, write_timeout_s: float, window_s: float,
                 config: FetchConfig = FetchConfig()) -> None:
        self.transfer = transfer
        self.fetches = PeerFetches(worker_id=worker_id, model=model, finish=engine.finish_prefix_fetch,
                                   write_timeout_s=write_timeout_s, window_s=window_s, config=config)
        self.counters = self.fetches.counters
        self.worker_id = worker_id
        self._engine = engine
        self._store = store
        self._bus = bus
        self._subjects = subjects

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
            slot = await engine.reserve_prefix_fetch(fetch_id, prompt, source.num_blocks)
        except BaseException:  # cancelled meanwhile: undo whatever the engine thread reserved
            engine.finish_prefix_fetch(fetch_id, 0)
            raise
        spec = engine.kv_spec
        ask, reason = self.fetches.ask(fetch_id, request.request_id, slot, now=time.time(),
                                       block_size=spec.block_size, block_bytes=spec.bytes_per_block,
                                       prefill_tokens_per_s=engine.stats().prefill_tokens_per_s)
        if ask is None:
            log.debug("%s: not fetching from %s: %s", request.request_id, source.worker_id, reason)
            return 0
        started = time.monotonic()
        outcome = FetchOutcome(0, False)
        try:
            with tracing.child_span("kv.fetch", holder=source.worker_id, num_blocks=len(ask.block_ids)):
                outcome = await self._ask(source.worker_id, ask)
        finally:  # also when the request is cancelled meanwhile
            self.fetches.settle(ask, outcome.num_blocks, outcome.is_settled)
        elapsed = time.monotonic() - started
        self.fetches.record(outcome.num_blocks, elapsed, spec.bytes_per_block)
        if outcome.num_blocks:
            log.info("%s: fetched %d KV blocks from %s in %.1f ms (%d cached here; %s)", request.request_id,
                     outcome.num_blocks, source.worker_id, elapsed * 1e3, ask.first_block, reason)
        return outcome.num_blocks

    async def _ask(self, holder: str, ask: KvFetchRequest) -> FetchOutcome:
        future = self.fetches.expect(ask)
        try:
            try:
                result = await self._bus.request(self._subjects.kv_fetch(holder), ask,
                                                 timeout_s=answer_timeout_s(ask, time.time()))
            except ServiceError as exc:
                log.warning("%s: KV fetch from %s failed (%s): computing the prefix here", ask.request_id, holder,
                            exc.message)
                return FetchOutcome(0, False)
            note = None
            if result.num_blocks:
                try:
                    note = await asyncio.wait_for(future, timeout=max(ask.write_timeout_s, 0.1))
                except asyncio.TimeoutError:
                    pass
            outcome = judge(result, note)
            if outcome.problem:
                log.log(logging.INFO if outcome.is_refusal else logging.WARNING,
                        "%s: %s %s: computing the prefix here", ask.request_id, holder, outcome.problem)
            return outcome
        finally:
            self.fetches.forget(ask)

    def deliver(self, message: bytes, num_bytes: int = 0, received_at: float = 0.0) -> bool:
        """A NIXL notification: True if it names a fetch of ours (consumed), else False."""
        return self.fetches.deliver(message)

    @property
    def has_waiting(self) -> bool:
        return self.fetches.has_waiting

    def tick(self, now: float) -> None:
        self.fetches.tick(now)

    async def release_quarantine(self) -> None:
        """Wait until no late write can land in any failed fetch's blocks, then give them back: a
        draining worker calls this before its poll loop (whose ticks would do it) stops, so that
        a role flip right after a failed fetch does not keep those blocks out of the pool."""
        ends_at = self.fetches.quarantined_until
        if ends_at is not None:
            log.info("waiting %.1fs for %d failed fetches' blocks to be safe to reuse",
                     max(0.0, ends_at - time.time()), self.fetches.num_quarantined)
            await asyncio.sleep(max(0.0, ends_at - time.time()))
            self.tick(ends_at)

    # -- holder side --------------------------------------------------------------------------------
    async def _pin(self, ask: KvFetchRequest) -> list[int]:
        """Pin the leading run of the asked chain held here: blocks in host memory are copied into
        the pool, blocks on disk are read first (while the ask's write deadline allows)."""
        hashes, engine = ask.block_hashes, self._engine
        while (await engine.read_prefix_from_disk(hashes)) and time.time() < ask.write_deadline:
            await asyncio.sleep(0.005)
        return await engine.lend_prefix(ask.fetch_id, hashes)

    async def lend(self, ask: KvFetchRequest) -> KvFetchResult:
        """Write the cached blocks another worker asks for into its pool; answer once written."""
        def refused(why: str, write_failed: bool = False) -> KvFetchResult:
            log.info("%s: lent no KV blocks to %s: %s", ask.request_id, ask.decode_worker_id, why)
            return KvFetchResult(fetch_id=ask.fetch_id, message=why, write_failed=write_failed)

        if (why := refusal(ask, self.fetches.model, time.time())) is not None:
            return refused(why)
        try:
            peer = await connect_peer(self._store, ask.decode_worker_id, self.transfer)
        except KVTransferFailed as exc:
            return refused(f"cannot reach it: {exc}")
        try:
            block_ids = await self._pin(ask)
            local = lent_block_ids(ask, block_ids)
            if not local:
                return refused(f"holds {len(block_ids)} of the {len(ask.block_hashes)} leading blocks now")
            if time.time() > ask.write_deadline:
                return refused("past its write deadline before the blocks were pinned")
            note = PrefillNotification(transfer_id=ask.fetch_id, request_id=ask.request_id, num_blocks=len(local),
                                       prefill_worker_id=self.worker_id)
            try:
                await write_and_wait(self.transfer, peer, local, ask.block_ids[:len(local)], note.to_bytes(),
                                     ask.write_timeout_s)
            except KVTransferFailed as exc:
                return refused(f"the write failed: {exc}", write_failed=True)
        finally:  # queued behind the lend even if this handler was cancelled while it waited
            self._engine.return_prefix(ask.fetch_id)
        self.fetches.lent(len(local))
        log.info("%s: lent %d KV blocks to %s", ask.request_id, len(local), ask.decode_worker_id)
        return KvFetchResult(fetch_id=ask.fetch_id, num_blocks=len(local))
