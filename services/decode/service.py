"""decode: one engine behind ``<ns>.v1.decode.<worker>.generate``.

Lifecycle: load the model → warm up (so no user request pays first-run costs) → serve, then
register as ``ready`` and heartbeat → on SIGTERM (or a ``drain`` control request) mark itself
``draining`` in the registry, stop taking requests, finish the ones in flight, deregister.
Meanwhile it publishes WorkerLoad about once a second and batches the engine's KV events into
the JetStream-backed ``kv.events.<worker>`` subject for kv-index.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from shared.bus import Bus, ServiceError, WorkerRegistry
from shared.disagg import RemotePrefills
from shared.engine import AsyncEngine, EngineError, InvalidRequestError
from shared.protocol import (CancelRequest, ControlRequest, ControlResult, GenerateRequest, Subjects, TokenChunk,
                             WorkerInfo, WorkerLoad)
from shared.runtime.worker import EngineWorker
from shared.telemetry.metrics import RecentMean
from shared.transfer import TransferUnavailable
from services.decode.config import DecodeSettings
from services.decode.remote import RemotePrefiller
from services.decode.translate import engine_params, token_chunk

log = logging.getLogger(__name__)


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(self, settings: DecodeSettings, bus: Bus, registry: WorkerRegistry,
                 engine: AsyncEngine, remote: RemotePrefiller | None = None) -> None:
        super().__init__(settings, bus, registry, engine)
        self._ttft = RecentMean(10.0)
        self._itl = RecentMean(10.0)
        self.num_requests_total = 0
        self.num_requests_aborted = 0
        self.num_local_prefills = 0
        self.remote = remote  # None: remote prefill off (disabled, or no KV transfer here)

    def info(self) -> WorkerInfo:
        return self._info(generate_subject=self._subjects.decode_generate(self.worker_id).subject,
                          cancel_subject=self._subjects.decode_cancel(self.worker_id).subject)

    async def start(self) -> None:
        """Serve, then register as ready (serving first: once listed, requests may come)."""
        s = self._subjects
        await self.start_kv_events()
        await self._bus.subscribe(s.decode_cancel(self.worker_id), self.cancel)
        await self._bus.serve(s.control(self.worker_id), self.control)
        await self._bus.serve_stream(s.decode_generate(self.worker_id), self.generate)
        self.state = "ready"
        await self._registry.put(self.info())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        if self.state != "ready":
            raise ServiceError("rejected", f"worker {self.worker_id} is {self.state}")
        self.num_requests_total += 1
        started = last = time.monotonic()
        index = 0
        params = engine_params(request.sampling)
        try:
            handle = await self.remote.start(request, params) if self.remote is not None else None
            if handle is None:
                self.num_local_prefills += 1
                outputs = self.engine.generate(request.request_id, request.prompt_token_ids, params,
                                               request.priority)
            else:
                outputs = self.remote.prefills.outputs(handle)
            async for out in outputs:
                now = time.monotonic()
                (self._ttft if index == 0 else self._itl).observe(now - last)
                last = now
                if out.finish_reason == "abort":
                    self.num_requests_aborted += 1
                if out.finish_reason is not None:
                    # Admission counts what it admitted on top of the last report until a newer
                    # one arrives: report the freed capacity before the caller can send more.
                    await self.publish_load()
                yield token_chunk(out, index, self.worker_id)
                index += 1
        except InvalidRequestError as exc:
            raise ServiceError("bad_request", str(exc), getattr(exc, "field", None)) from None
        except (EngineError, ValueError) as exc:
            raise ServiceError("rejected", str(exc)) from None
        log.debug("%s done in %.3fs", request.request_id, time.monotonic() - started)

    async def cancel(self, request: CancelRequest) -> None:
        log.info("cancel %s: %s", request.request_id, request.reason)
        self.engine.abort(request.request_id)
        if self.remote is not None:
            self.remote.prefills.cancel(request.request_id)

    async def control(self, request: ControlRequest) -> ControlResult:
        if request.action in ("drain", "stop"):
            self.drain_requested.set()
        elif request.action == "configure":
            changes = {k: v for k in ("max_local_prefill_tokens", "max_prefill_queue")
                       if (v := getattr(request, k)) is not None}
            if changes and self.remote is None:
                raise ServiceError("bad_request", f"worker {self.worker_id} has remote prefill off")
            if changes:
                prefills = self.remote.prefills
                prefills.config = dataclasses.replace(prefills.config, **changes)
                log.info("disaggregation thresholds now %s", prefills.config)
        state = "draining" if self.drain_requested.is_set() else self.state
        thresholds = dataclasses.asdict(self.remote.prefills.config) if self.remote is not None else {}
        return ControlResult(worker_id=self.worker_id, state=state, num_in_flight=self._bus.num_in_flight,
                             **thresholds)

    def load(self) -> WorkerLoad:
        remote, prefills = self.remote, self.remote.prefills if self.remote else None
        return self._load(
            ttft_recent_s=self._ttft.mean(), itl_recent_s=self._itl.mean(),
            num_requests_total=self.num_requests_total, num_requests_aborted=self.num_requests_aborted,
            num_local_prefills=self.num_local_prefills,
            num_remote_prefills=prefills.num_remote if prefills else 0,
            num_prefill_fallbacks=prefills.num_fallbacks if prefills else 0,
            kv_bytes_received=remote.transfer.stats.num_bytes_received if remote else 0)

    async def drain(self, heartbeat: asyncio.Task) -> None:
        """Stay listed as ``draining`` (admission skips it) while in-flight requests finish."""
        self.state = "draining"
        await self._registry.put(self.info())
        num_left = await self._bus.stop_serving(self._settings.drain_timeout_s)
        if num_left:
            log.warning("drain timeout: %d requests cut off", num_left)
        heartbeat.cancel()  # no beat may re-register us after the delete
        await asyncio.gather(heartbeat, return_exceptions=True)
        await self._registry.delete(self.worker_id)


async def run(settings: DecodeSettings, stop: asyncio.Event) -> None:
    log.info("loading %s", settings.model)
    engine = await asyncio.to_thread(AsyncEngine.start, settings.engine_config())
    bus = await Bus.connect(settings.nats_url, settings.worker_id)
    subjects = Subjects(settings.namespace)
    tasks: list[asyncio.Task] = []
    transfer = store = None
    try:
        registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=settings.registry_ttl_s,
                                             watch=settings.remote_prefill)
        remote = None
        if settings.remote_prefill:
            transfer, store = await _open_transfer(settings, bus, engine)
        if transfer is not None:
            prefills = RemotePrefills(
                worker_id=settings.worker_id, model=settings.model, engine=engine, config=settings.disagg_config(),
                timeout_s=settings.remote_prefill_timeout_s, write_timeout_s=settings.kv_write_timeout_s)
            remote = RemotePrefiller(prefills, bus=bus, registry=registry, transfer=transfer, subjects=subjects)
        worker = DecodeWorker(settings, bus, registry, engine, remote)
        await worker.warm_up()
        await worker.start()
        tasks = [asyncio.create_task(c) for c in (
            registry.heartbeat(worker.info), worker.publish_load_forever(),
            worker.publish_kv_events_forever())]
        if remote is not None:
            tasks.append(asyncio.create_task(remote.poll_forever()))
        log.info("decode worker %s ready (model %s, %d KV blocks; remote prefill %s)", worker.worker_id,
                 settings.model, engine.stats().num_blocks_total,
                 f"on above {remote.prefills.config.max_local_prefill_tokens} uncached tokens" if remote else "off")
        drain = asyncio.create_task(worker.drain_requested.wait())
        await asyncio.wait([asyncio.create_task(stop.wait()), drain],
                           return_when=asyncio.FIRST_COMPLETED)
        log.info("draining %d in-flight requests", bus.num_in_flight)
        await worker.drain(heartbeat=tasks[0])
    finally:
        for task in tasks:
            task.cancel()
        if store is not None:
            try:
                await store.delete(settings.worker_id)
            except Exception as exc:  # noqa: BLE001 — a stale entry only costs a failed write
                log.warning("withdrawing NIXL metadata failed: %s", exc)
        await bus.close()
        await asyncio.to_thread(engine.shutdown)
        if transfer is not None:
            transfer.close()
        log.info("stopped")


async def _open_transfer(settings: DecodeSettings, bus: Bus, engine: AsyncEngine):
    """A NIXL agent over this worker's KV pool, its metadata published for prefill workers; or
    (None, None) with the reason logged where NIXL cannot run (remote prefill is then off)."""
    from shared.transfer.nats_metadata import NatsMetadataStore
    from shared.transfer.nixl import NixlTransfer
    from shared.transfer import publish_metadata

    try:
        transfer = NixlTransfer(settings.worker_id)
    except TransferUnavailable as exc:
        log.warning("remote prefill OFF: %s", exc)
        return None, None
    transfer.register_kv_pool(engine.engine.kv_cache, engine.engine.kv_spec)
    store = await NatsMetadataStore.open(bus, Subjects(settings.namespace).nixl_bucket)
    await publish_metadata(store, settings.worker_id, transfer)
    return transfer, store
