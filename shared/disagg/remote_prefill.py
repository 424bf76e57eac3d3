"""Remote-prefill bookkeeping of a decode worker: the pure core its service drives.

For each request the policy (``shared.policy.disagg``) decides, with the locally cached prefix,
whether to prefill locally or remotely. Remotely: reserve the prompt's blocks (reusing the local
prefix cache) and hand back the ``RemotePrefillRequest`` to publish; the request waits until its
NIXL notification arrives (``deliver``), then joins the decode batch. Without a notification by
the end of its window, or with a ``failed`` one, or when the publish failed, it prefills locally.

Time only comes in as ``now`` (wall-clock seconds, the prefill worker's clock too): ``tick(now)``
ends the waits whose window closed and releases the blocks of windows that closed (the waits and
the held blocks are kept by ``shared.disagg.incoming``, as peer fetch's are). The service
publishes, reads the queue state and the registry, polls the transfer, and ticks.

Block safety: a prefill worker writes only under a lease on the reservation (``shared.disagg.lease``),
starts a write only while its lease outlasts the write's timeout and before ``write_deadline``. The
reserved blocks stay owned by the request (``keep_kv``) until every lease granted on them has
expired, even if the request finished or was cancelled earlier, so no write, late or repeated,
can land in blocks that another request reuses. A reservation whose leases all lapsed without the
KV (its prefill worker died or hangs) is prefilled locally at once, not at the end of its window;
so is one nobody leased once no prefill worker is left in the registry (``no_prefill_workers``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from shared.engine import AsyncEngine, EngineOutput, SamplingParams
from shared.disagg.incoming import Delivery, IncomingWrites
from shared.disagg.lease import CLOCK_MARGIN_S, ReservationLeases
from shared.policy.disagg import DisaggConfig, DisaggDecision, DisaggInput, decide_prefill, may_go_remote
from shared.protocol import (GenerateRequest, PrefillLeaseRequest, PrefillLeaseResult, PrefillNotification,
                             RemotePrefillRequest)
from shared.telemetry.phases import RemoteTimes

log = logging.getLogger(__name__)

QUEUE_STATE_MAX_AGE_S = 0.25  # the queue length steers a heuristic: a slightly old value is fine


@dataclass
class RemotePrefill:
    """One request whose prompt a prefill worker computes; ``message`` goes on the prefill queue."""

    message: RemotePrefillRequest
    window_end: float
    reason: str
    future: asyncio.Future[PrefillNotification | None] = field(repr=False)
    kv_written: bool = False
    release_at: float = 0.0  # when the last lease on its blocks expires (set once the wait ends)
    # for the request's TTFT phases (time.monotonic(), set by the service): on the queue, KV in place
    published_at: float | None = None
    delivered_at: float | None = None
    note: PrefillNotification | None = None

    def times(self) -> RemoteTimes | None:
        """The remote prefill's timeline, when its KV was written and every part of it is known."""
        note = self.note
        if (not self.kv_written or note is None or note.queue_wait_s is None or note.prefill_s is None
                or self.published_at is None or self.delivered_at is None):
            return None
        return RemoteTimes(self.published_at, self.delivered_at, note.queue_wait_s, note.prefill_s)

    @property
    def request_id(self) -> str:
        return self.message.request_id

    @property
    def transfer_id(self) -> str:
        return self.message.transfer_id


class RemotePrefills:
    def __init__(self, *, worker_id: str, model: str, engine: AsyncEngine, config: DisaggConfig,
                 timeout_s: float, write_timeout_s: float, lease_s: float | None = None) -> None:
        if write_timeout_s + CLOCK_MARGIN_S >= timeout_s:
            raise ValueError(f"remote prefill timeout ({timeout_s}s) must exceed the KV write timeout "
                             f"({write_timeout_s}s) by more than {CLOCK_MARGIN_S}s")
        lease_s = write_timeout_s + 2.0 if lease_s is None else lease_s
        if write_timeout_s + CLOCK_MARGIN_S >= lease_s:
            raise ValueError(f"prefill lease ({lease_s}s) must exceed the KV write timeout ({write_timeout_s}s) "
                             f"by more than {CLOCK_MARGIN_S}s, or no write could ever start")
        self.leases = ReservationLeases(lease_s)
        self.worker_id = worker_id
        self.model = model
        self.config = config
        self.timeout_s = timeout_s
        self.write_timeout_s = write_timeout_s
        self._engine = engine
        # transfer id → the wait for its KV; request id → its blocks, held until no lease is valid
        self._incoming = IncomingWrites(release=engine.release_kv)
        self._by_request: dict[str, str] = {}  # request id → transfer id
        self._queue_state: tuple[float, int | None] | None = None  # (read at, requests queued)
        self.num_remote = 0
        self.num_fallbacks = 0

    # -- what the service observes for us ---------------------------------------------------------
    def needs_queue_state(self, now: float) -> bool:
        return self._queue_state is None or now - self._queue_state[0] > QUEUE_STATE_MAX_AGE_S

    def observe_queue(self, now: float, num_queued: int | None) -> None:
        """The prefill queue's length read at ``now``; None: no queue, or it could not be read."""
        self._queue_state = (now, num_queued)

    def may_go_remote(self, num_prompt_tokens: int, now: float) -> bool:
        """Whether the policy could send this prompt remote in the best case (nothing cached, prefill
        workers idle): if not, the service need not read the queue state nor the engine its cache."""
        return may_go_remote(num_prompt_tokens, self.config, self._engine.block_size)

    @property
    def has_waiting(self) -> bool:
        return self._incoming.has_waiting

    # -- deciding and reserving --------------------------------------------------------------------
    async def reserve(self, request: GenerateRequest, params: SamplingParams, *, now: float,
                      has_prefill_workers: bool) -> RemotePrefill | None:
        """Ask the policy (once, in the engine thread, with the locally cached prefix) and, if it
        says remote and the pool has room, reserve the prompt's blocks. None: prefill locally."""
        prompt = request.prompt_token_ids
        queued = self._queue_state[1] if self._queue_state is not None else None
        inp = DisaggInput(now, len(prompt), 0, queued, has_prefill_workers, self._engine.block_size)
        decisions: list[DisaggDecision] = []

        def decide(num_cached: int) -> bool:  # runs in the engine thread, with the local cache state
            decisions.append(decide_prefill(replace(inp, cached_tokens=num_cached), self.config))
            return decisions[-1].remote

        slot = await self._engine.reserve_remote_prefill(request.request_id, prompt, params, request.priority,
                                                         keep_kv=True, decide=decide, deadline=request.deadline_at)
        if slot is None:
            why = decisions[-1].reason if decisions and not decisions[-1].remote else "KV pool full now"
            log.debug("%s: local prefill (%s)", request.request_id, why)
            return None
        window_end, transfer_id = now + self.timeout_s, uuid.uuid4().hex
        message = RemotePrefillRequest(
            request_id=request.request_id, transfer_id=transfer_id, model=self.model, prompt_token_ids=prompt,
            decode_worker_id=self.worker_id, block_ids=slot.block_ids, block_size=slot.block_size,
            num_cached_tokens=slot.num_cached_tokens,
            write_deadline=window_end - self.write_timeout_s - CLOCK_MARGIN_S,
            write_timeout_s=self.write_timeout_s, priority=request.priority, created_at=now)
        future = self._incoming.expect(transfer_id, request.request_id, wait_until=window_end)
        prefill = RemotePrefill(message, window_end, decisions[-1].reason, future)
        self._by_request[request.request_id] = prefill.transfer_id
        self.leases.open(prefill.transfer_id)
        log.info("%s: remote prefill of %d uncached tokens (%d cached): %s", request.request_id,
                 len(prompt) - slot.num_cached_tokens, slot.num_cached_tokens, prefill.reason)
        return prefill

    def publish_failed(self, prefill: RemotePrefill, error: BaseException) -> None:
        """The message never reached the queue (full, NATS away): prefill here, now."""
        log.warning("%s: prefill queue publish failed (%s): prefilling locally", prefill.request_id, error)
        self._incoming.end_wait(prefill.transfer_id)

    # -- notifications -----------------------------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        """The client went away: stop waiting for the KV (the blocks stay held until the window
        closes all the same)."""
        transfer_id = self._by_request.get(request_id)
        if transfer_id is not None:
            self._incoming.end_wait(transfer_id)

    def deliver(self, payload: bytes, num_bytes: int, received_at: float | None = None) -> None:
        """A NIXL notification: the first for a waiting transfer resolves its wait. ``received_at``
        (time.monotonic()) dates the KV's arrival for the request's TTFT phases."""
        delivery, note = self._incoming.deliver(payload, received_at)
        if delivery is Delivery.MALFORMED:
            log.warning("ignoring a malformed KV notification (%d bytes written)", num_bytes)
        elif delivery is not Delivery.TAKEN:
            log.info("%s: late or repeated KV notification (%s) ignored", note.request_id, note.status)

    def grant_lease(self, request: PrefillLeaseRequest, now: float) -> PrefillLeaseResult:
        """A prefill worker's claim or renewal: granted while the reservation still waits for its KV."""
        expires_at = None
        if self._incoming.is_waiting(request.transfer_id):
            expires_at = self.leases.grant(request.transfer_id, request.prefill_worker_id, now)
        if expires_at is None:
            log.info("%s: lease refused to %s (no longer waiting for its KV)", request.request_id,
                     request.prefill_worker_id)
        return PrefillLeaseResult(transfer_id=request.transfer_id, expires_at=expires_at,
                                  lease_s=self.leases.lease_s)

    def tick(self, now: float) -> None:
        """End the waits whose leases lapsed or whose window closed (prefill locally), release blocks
        whose last lease expired."""
        for transfer_id in self.leases.lapsed(now):
            if (ended := self._incoming.end_wait(transfer_id)) is not None:
                log.warning("%s: the prefill worker's lease lapsed without the KV (it died or hangs): "
                            "prefilling locally", ended.request_id)
        for ended in self._incoming.tick(now):
            log.warning("%s: no KV from a prefill worker within %.1fs: prefilling locally",
                        ended.request_id, self.timeout_s)

    def no_prefill_workers(self) -> None:
        """No prefill worker of the model is listed any more (the last one died, left or flipped):
        nobody can take the reservations still on the queue, so prefill them here now instead of
        at the end of their windows. One leased meanwhile ends when its lease lapses; a prefill
        worker that takes one of these later is refused a lease and drops it."""
        for transfer_id in self.leases.unclaimed():
            if (ended := self._incoming.end_wait(transfer_id)) is not None:
                log.warning("%s: no prefill worker is left to take it: prefilling locally", ended.request_id)

    def _forget(self, prefill: RemotePrefill) -> None:
        """The wait is over: no more leases; the blocks go back once the last one granted expired."""
        prefill.release_at = self.leases.close(prefill.transfer_id) or 0.0
        if (expected := self._incoming.forget(prefill.transfer_id)) is not None:
            prefill.delivered_at = expected.received_at
        if self._by_request.get(prefill.request_id) == prefill.transfer_id:
            del self._by_request[prefill.request_id]

    # -- the request's tokens ----------------------------------------------------------------------
    async def outputs(self, prefill: RemotePrefill) -> AsyncIterator[EngineOutput]:
        """Wait for the KV (or the end of the wait), then stream the request's tokens from the
        engine; its blocks go back to the pool once the last lease on them has expired."""
        engine, request_id = self._engine, prefill.request_id
        try:
            note = await prefill.future
        except BaseException:  # the handler was cancelled (shutdown): end the request
            self._forget(prefill)
            engine.abort(request_id)
            engine.finish_remote_prefill(request_id, kv_written=False)
            engine.discard_stream(request_id)
            self._incoming.hold(request_id, prefill.release_at)
            raise
        self._forget(prefill)
        prefill.note = note
        prefill.kv_written = note is not None and note.status == "ok"
        engine.finish_remote_prefill(request_id, kv_written=prefill.kv_written)
        if prefill.kv_written:
            self.num_remote += 1
        else:
            self.num_fallbacks += 1
            if note is not None:
                log.warning("%s: prefill worker %s gave up (%s): prefilling locally", request_id,
                            note.prefill_worker_id, note.message)
        try:
            async for out in engine.stream(request_id):
                yield out
        finally:
            self._incoming.hold(request_id, prefill.release_at)
