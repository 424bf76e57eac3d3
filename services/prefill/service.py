"""prefill: pulls the global prefill queue, computes each prompt's KV and writes it with NIXL into
the decode worker's reserved blocks, then acknowledges the message.

The ack comes only after the write completed and its notification was sent: a worker that dies
before it leaves the message unacknowledged, and JetStream redelivers it to another prefill worker
``ack_wait_s`` after the last ``in_progress`` (sent every third of that while prefilling). Writes
are idempotent (full prompt blocks only, same bytes), and the decode worker takes the first
notification and ignores the rest, so a redelivery after a completed write is harmless.

It writes only under a lease on the reservation (``shared.disagg.lease``), claimed from the decode
worker before prefilling and renewed meanwhile, and starts the write only while the lease outlasts
the write's timeout: a decode worker that stopped waiting (its own timeout, or it gave us up for
dead) refuses the lease, and the request is dropped unwritten, as is one past its ``write_deadline``.
A request whose decode worker is gone (no NIXL metadata, or the write fails) is dropped and acked;
the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time

from shared.bus import Bus, QueueMessage, ServiceError, WorkerRegistry
from shared.disagg.lease import PrefillLease
from shared.disagg.prefill_queue import PrefillQueues
from shared.engine import AsyncEngine, EngineError, SamplingParams
from shared.protocol import (ControlRequest, ControlResult, PrefillLeaseRequest, PrefillNotification,
                             RemotePrefillRequest, WorkerInfo, WorkerLoad)
from services.worker.engine_worker import EngineWorker
from services.worker.metrics import WorkerMetrics
from shared.telemetry import tracing
from shared.telemetry.logs import bind_request_id
from shared.telemetry.metrics import RecentMean
from shared.transfer import KvTransfer, KVTransferFailed, MetadataStore, connect_peer, wait_written, write_and_wait
from services.prefill.config import PrefillSettings

log = logging.getLogger(__name__)

_PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
_LEASE_TIMEOUT_S = 1.0  # a decode worker answers from memory; no answer in this is no lease


class _Dropped(Exception):
    """The request cannot be served; ``notify``: tell the decode worker (it prefills locally now)."""

    def __init__(self, reason: str, *, notify: bool) -> None:
        super().__init__(reason)
        self.notify = notify


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, settings: PrefillSettings, bus: Bus, registry: WorkerRegistry, engine: AsyncEngine,
                 transfer: KvTransfer, store: MetadataStore, metrics: WorkerMetrics | None = None, **kw) -> None:
        super().__init__(settings, bus, registry, engine, **kw)
        self._metrics = metrics if metrics is not None else WorkerMetrics()
        self.transfer = transfer
        self._store = store
        self._prefill_time = RecentMean(10.0)
        self._slots = asyncio.Semaphore(settings.max_concurrent_prefills)
        self._tasks: set[asyncio.Task] = set()
        self._queues: PrefillQueues | None = None
        self._loops: list[asyncio.Task] = []  # the puller first
        self.num_requests_total = 0
        self.num_written = 0
        self.num_dropped = 0

    def info(self) -> WorkerInfo:
        return self._info(generate_subject=self._subjects.prefill_queue_all().subject)

    def load(self) -> WorkerLoad:
        return self._load(ttft_recent_s=self._prefill_time.mean(), num_requests_total=self.num_requests_total,
                          num_remote_prefills=self.num_written, num_prefills_dropped=self.num_dropped,
                          kv_bytes_sent=self.transfer.stats.num_bytes_sent)

    async def start(self) -> None:
        s, cfg = self._subjects, self._settings
        await self._bus.ensure_stream(s.prefill_stream, [s.prefill_queue_all().subject],
                                      max_age_s=cfg.queue_max_age_s, max_msgs=cfg.queue_max_msgs, work_queue=True)
        self._queues = await PrefillQueues.open(self._bus, s, ack_wait_s=cfg.ack_wait_s, max_deliver=cfg.max_deliver,
                                                max_skips=cfg.max_priority_skips)
        self.state = "ready"
        self._loops = [asyncio.create_task(c) for c in (self.pull_forever(), self.progress_forever())]
        await self._registry.put(self.info())
        log.info("prefill worker %s ready (model %s, %d KV blocks, up to %d prompts at once)", self.worker_id,
                 cfg.model, self.engine.stats().num_blocks_total, cfg.max_concurrent_prefills)

    async def control(self, request: ControlRequest) -> ControlResult:
        return ControlResult(worker_id=self.worker_id, state=self.state, num_in_flight=len(self._tasks))

    # -- the queue --------------------------------------------------------------------------------
    async def pull_forever(self) -> None:
        """Fetch as many messages as there are free prefill slots; each runs in its own task, so
        the engine batches concurrent prompts together."""
        while self.state == "ready":
            await self._slots.acquire()
            free = 1
            while free < self._settings.max_concurrent_prefills and not self._slots.locked():
                await self._slots.acquire()
                free += 1
            try:
                msgs = await self._queues.fetch(free)
            except Exception as exc:  # noqa: BLE001 — reconnecting: try again shortly
                log.warning("prefill queue fetch failed: %s", exc)
                msgs = []
                await asyncio.sleep(0.5)
            for _ in range(free - len(msgs)):
                self._slots.release()
            for msg in msgs:
                task = asyncio.create_task(self._handle(msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _handle(self, msg: QueueMessage[RemotePrefillRequest]) -> None:
        bind_request_id(msg.payload.request_id)
        taken_at = time.monotonic()
        queue_wait_s = max(time.time() - msg.published_at, 0.0)
        try:
            progress = asyncio.create_task(self._report_progress(msg))
            try:
                # one trace with the request: the decode worker's publish is the parent
                with tracing.server_span("prefill", msg.headers, tracing.SpanKind.CONSUMER,
                                         request_id=msg.payload.request_id, delivery=msg.num_delivered):
                    tracing.record_span("prefill_queue.wait", taken_at - queue_wait_s, taken_at)
                    await self.serve(msg.payload, msg.num_delivered, msg.stream_seq, queue_wait_s)
            finally:
                progress.cancel()
            await msg.ack()
        except asyncio.CancelledError:
            raise  # shutdown mid-prefill: unacknowledged, so redelivered to another worker
        except Exception:  # noqa: BLE001 — never let one message stop the worker
            log.exception("prefill request failed; it will be redelivered")
        finally:
            self._slots.release()

    async def _report_progress(self, msg: QueueMessage) -> None:
        while True:
            await asyncio.sleep(self._settings.ack_wait_s / 3)
            try:
                await msg.in_progress()
            except Exception as exc:  # noqa: BLE001
                log.warning("in_progress report failed: %s", exc)

    async def serve(self, request: RemotePrefillRequest, delivery: int = 1, seq: int = 0,
                    queue_wait_s: float | None = None) -> None:
        """Prefill and write one request (or drop it): afterwards the message may be acked.
        ``delivery``: how often the queue has delivered it; ``seq``: its stream sequence;
        ``queue_wait_s``: how long it waited on the queue (told to the decode worker)."""
        self.num_requests_total += 1
        rid = request.request_id
        if delivery == 1 and request.created_at:  # a redelivery's wait includes the failed attempt
            self._metrics.queue_wait.observe(max(0.0, time.time() - request.created_at))
        if delivery > 1:
            log.info("%s: delivery %d (a prefill worker died or was slow)", rid, delivery)
        peer = None
        lease = PrefillLease()
        try:
            peer = await self._peer(request)
            await self._renew(request, lease)
            keeper = asyncio.create_task(self._keep_lease(request, lease))
            try:
                num_blocks = await self._prefill_and_write(request, peer, f"{seq}-{delivery}", queue_wait_s,
                                                             lease)
            finally:
                keeper.cancel()
        except _Dropped as exc:
            self.num_dropped += 1
            log.warning("%s: dropped: %s", rid, exc)
            if exc.notify and peer is not None:
                await self._notify_failed(peer, request, str(exc))
            return
        self.num_written += 1
        log.info("%s: wrote %d KV blocks into %s", rid, num_blocks, request.decode_worker_id)

    async def _peer(self, request: RemotePrefillRequest) -> str:
        if time.time() > request.write_deadline:
            raise _Dropped("past its write deadline (the decode worker prefills it itself)", notify=False)
        try:
            return await connect_peer(self._store, request.decode_worker_id, self.transfer)
        except KVTransferFailed as exc:
            raise _Dropped(f"decode worker {request.decode_worker_id} unreachable: {exc}", notify=False) from None

    async def _renew(self, request: RemotePrefillRequest, lease: PrefillLease) -> None:
        """Claim or renew the lease; _Dropped once the decode worker refuses it."""
        ask = PrefillLeaseRequest(transfer_id=request.transfer_id, request_id=request.request_id,
                                  prefill_worker_id=self.worker_id)
        try:
            result = await self._bus.request(self._subjects.prefill_lease(request.decode_worker_id), ask,
                                             timeout_s=_LEASE_TIMEOUT_S)
        except ServiceError as exc:  # no answer: the lease runs out unless a later renewal gets through
            log.warning("%s: lease renewal at %s failed: %s", request.request_id, request.decode_worker_id,
                        exc.message)
            return
        lease.granted(result.expires_at, result.lease_s)
        if lease.is_refused:
            raise _Dropped("the decode worker refused the lease (it no longer waits for this KV)", notify=False)

    async def _keep_lease(self, request: RemotePrefillRequest, lease: PrefillLease) -> None:
        while not lease.is_refused:
            await asyncio.sleep(max(0.05, lease.renew_in_s(time.time())))
            try:
                await self._renew(request, lease)
            except _Dropped:
                return  # the write checks the lease before it starts

    async def _check_lease(self, request: RemotePrefillRequest, lease: PrefillLease) -> None:
        """Before the write: the lease must outlast it, renewed now if need be."""
        if not lease.may_start_write(time.time(), request.write_timeout_s):
            await self._renew(request, lease)
        if not lease.may_start_write(time.time(), request.write_timeout_s):
            raise _Dropped("no lease that outlasts the write (the decode worker may reuse the blocks)",
                           notify=False)

    async def _prefill_and_write(self, request: RemotePrefillRequest, peer: str, attempt: str,
                                 queue_wait_s: float | None, lease: PrefillLease) -> int:
        rid = request.request_id
        if request.model != self._settings.model:
            raise _Dropped(f"model {request.model!r} is not this worker's {self._settings.model!r}", notify=True)
        local_bs = self.engine.block_size
        start, end = request.num_cached_tokens, request.num_full_blocks * request.block_size
        if start % local_bs:
            raise _Dropped(f"cached prefix of {start} tokens does not start a {local_bs}-token block here",
                           notify=True)
        engine_id = f"prefill-{request.transfer_id}-{attempt}"  # a duplicate message is its own request
        log.info("%s: prefilling %d tokens (%d cached at %s)", rid, len(request.prompt_token_ids), start,
                 request.decode_worker_id)
        started = time.monotonic()
        try:
            with tracing.child_span("prefill.compute", num_tokens=len(request.prompt_token_ids) - start):
                async for _ in self.engine.generate(engine_id, request.prompt_token_ids, _PREFILL_PARAMS,
                                                    request.priority, keep_kv=True):
                    pass
            prefill_s = time.monotonic() - started
            self._prefill_time.observe(prefill_s)
            self._metrics.prefill.observe(prefill_s)
            block_ids = await self.engine.request_block_ids(engine_id)
            if time.time() > request.write_deadline:
                raise _Dropped("prefilled after its write deadline (the decode worker prefills it itself)",
                               notify=False)
            await self._check_lease(request, lease)
            local = block_ids[start // local_bs:-(-end // local_bs)] if end > start else []
            note = PrefillNotification(transfer_id=request.transfer_id, request_id=rid,
                                       num_blocks=len(request.write_block_ids), prefill_worker_id=self.worker_id,
                                       queue_wait_s=queue_wait_s, prefill_s=prefill_s)
            try:
                write_started = time.monotonic()
                with tracing.child_span("kv.write", num_blocks=len(local), decode_worker=request.decode_worker_id):
                    await write_and_wait(self.transfer, peer, local, request.write_block_ids, note.to_bytes(),
                                         request.write_timeout_s)
                self._metrics.kv_write.observe(time.monotonic() - write_started)
            except KVTransferFailed as exc:
                raise _Dropped(f"KV write into {request.decode_worker_id} failed: {exc}", notify=False) from None
            return len(local)
        except (EngineError, ValueError) as exc:
            raise _Dropped(f"prefill failed: {exc}", notify=True) from None
        finally:
            self.engine.release_kv(engine_id)

    async def _notify_failed(self, peer: str, request: RemotePrefillRequest, reason: str) -> None:
        note = PrefillNotification(transfer_id=request.transfer_id, request_id=request.request_id, status="failed",
                                   prefill_worker_id=self.worker_id, message=reason[:500])
        try:
            await wait_written(self.transfer, self.transfer.write_blocks(peer, [], [], note.to_bytes()), 5.0)
        except KVTransferFailed as exc:
            log.warning("%s: could not tell the decode worker: %s", request.request_id, exc)

    async def progress_forever(self) -> None:
        """Drive NIXL's progress between writes: without a progress thread, a notification sent on
        its own (``failed``) only leaves this process while the agent is polled."""
        while True:
            for note in self.transfer.get_notifications():
                log.debug("unexpected KV notification from %s ignored", note.peer)
            await asyncio.sleep(0.01)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Take no new messages, finish the prefills in flight (unfinished ones are redelivered)."""
        self.state = "draining"
        await self._registry.put(self.info())
        log.info("draining %d in-flight prefills", len(self._tasks))
        puller = self._loops[0]
        puller.cancel()
        await asyncio.gather(puller, return_exceptions=True)
        await self._queues.close()
        if self._tasks:
            _, left = await asyncio.wait(set(self._tasks), timeout=self._settings.drain_timeout_s
                                         if timeout_s is None else timeout_s)
            for task in left:
                task.cancel()
            if left:
                log.warning("drain timeout: %d prefills cut off (they will be redelivered)", len(left))
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)

