"""decode: one engine behind ``<ns>.v1.decode.<worker>.generate``.

The decode role of a worker process (``services.worker.process``): serve, then register as
``ready`` → on SIGTERM, a ``drain`` control request or a flip to prefill, mark itself ``draining``
in the registry, stop taking requests, finish the ones in flight. The process around it loads the
model, warms up, heartbeats, reports load, publishes KV events, and deregisters at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from shared.bus import Bus, ServiceError, WorkerRegistry
from shared.disagg import RemotePrefill
from shared.engine import AsyncEngine, EngineError, InvalidRequestError
from shared.protocol import (CancelRequest, ControlRequest, ControlResult, GenerateRequest, TokenChunk,
                             WorkerInfo, WorkerLoad)
from shared.protocol.workers import KvFetchLoad
from services.framework.lifecycle import every
from shared.telemetry import tracing
from shared.telemetry.metrics import RecentMean
from shared.telemetry.phases import worker_phases
from services.worker.engine_worker import EngineWorker
from services.worker.metrics import WorkerMetrics
from services.worker.origins import OriginWatch
from services.decode.config import DecodeSettings
from services.decode.fetch import PeerFetcher
from services.decode.remote import RemotePrefiller, poll_kv_forever
from services.decode.translate import engine_params, token_chunk

log = logging.getLogger(__name__)


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(self, settings: DecodeSettings, bus: Bus, registry: WorkerRegistry,
                 engine: AsyncEngine, remote: RemotePrefiller | None = None,
                 metrics: WorkerMetrics | None = None, fetcher: PeerFetcher | None = None, **kw) -> None:
        super().__init__(settings, bus, registry, engine, **kw)
        self._metrics = metrics if metrics is not None else WorkerMetrics()
        self._ttft = RecentMean(10.0)
        self._itl = RecentMean(10.0)
        self._itl_batch = RecentMean(10.0)  # the running requests when each ITL sample was taken
        self._output_tokens = RecentMean(30.0)  # output length of the requests finished recently
        self._output_tokens_by_priority: dict[int, RecentMean] = {}  # the same, by request priority
        self.num_requests_total = 0
        self.num_requests_aborted = 0
        self.num_local_prefills = 0
        self.num_local_only_prompt_tokens = 0  # uncached, of prompts no prefill worker would take
        self._running: set[str] = set()  # request ids received whose streams have not ended
        self._cancelled: set[str] = set()  # of those, cancelled (one may not have reached the engine yet)
        self.remote = remote  # None: remote prefill off (disabled, or no KV transfer here)
        self.fetcher = fetcher  # None: no prefix fetches from or for other workers
        self._loops: list[asyncio.Task] = []
        # requests whose gateway died are aborted, not generated to the end into a dead inbox
        self.origins = OriginWatch(bus, self._subjects, self.worker_id, self._abort_orphan)

    def info(self) -> WorkerInfo:
        return self._info(generate_subject=self._subjects.decode_generate(self.worker_id).subject,
                          cancel_subject=self._subjects.decode_cancel(self.worker_id).subject)

    async def start(self) -> None:
        """Serve, then register as ready (serving first: once listed, requests may come)."""
        s = self._subjects
        await self._bus.subscribe(s.decode_cancel(self.worker_id), self.cancel)
        await self._bus.serve_stream(s.decode_generate(self.worker_id), self.generate)
        if self.remote is not None:
            await self._bus.serve(s.prefill_lease(self.worker_id), self.remote.grant_lease)
        if self.fetcher is not None:
            await self._bus.serve(s.kv_fetch(self.worker_id), self.fetcher.lend)
        self._loops.append(asyncio.create_task(self.origins.run_forever()))
        if self.remote is not None:
            self._loops.append(asyncio.create_task(every(1.0, self.remote.check_prefill_workers,
                                                         "prefill worker check")))
        receivers = [r for r in (self.fetcher, self.remote) if r is not None]
        if receivers:
            self._loops.append(asyncio.create_task(poll_kv_forever(receivers[0].transfer, receivers)))
        self.state = "ready"
        await self._registry.put(self.info())
        log.info("decode worker %s ready (model %s, %d KV blocks; remote prefill %s; prefix fetch from peers %s)",
                 self.worker_id, self._settings.model, self.engine.stats().num_blocks_total,
                 f"on above {self.remote.config.max_local_prefill_tokens} uncached tokens"
                 if self.remote else "off", "on" if self.fetcher else "off")

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        if self.state != "ready":
            raise ServiceError("rejected", f"worker {self.worker_id} is {self.state}")
        if request.is_text:
            raise ServiceError("bad_request", f"worker {self.worker_id} takes token ids, not text",
                               "prompt_token_ids")
        self.num_requests_total += 1
        started = last = time.monotonic()
        index = 0
        local_only = self.remote is None or not self.remote.may_go_remote(len(request.prompt_token_ids))
        params = engine_params(request.sampling)
        self.origins.add(request)
        self._running.add(request.request_id)
        try:
            if self.fetcher is not None and request.kv_source is not None:
                await self.fetcher.fetch(request)
                if request.request_id in self._cancelled:  # the engine's abort came before the request did
                    log.info("%s: cancelled during its prefix fetch; not run", request.request_id)
                    return
            handle = await self.remote.start(request, params) if self.remote is not None else None
            if handle is None:
                self.num_local_prefills += 1
                outputs = self.engine.generate(request.request_id, request.prompt_token_ids, params,
                                               request.priority, deadline=request.deadline_at)
            else:
                outputs = self.remote.outputs(handle)
            async for out in outputs:
                now = time.monotonic()
                (self._ttft if index == 0 else self._itl).observe(now - last)
                if index:
                    self._itl_batch.observe(self.engine.num_running)
                (self._metrics.ttft if index == 0 else self._metrics.itl).observe(now - last)
                last = now
                if out.finish_reason == "abort":
                    self.num_requests_aborted += 1
                if out.finish_reason is not None:
                    if out.finish_reason != "abort":
                        self._output_tokens.observe(out.num_output_tokens, now)
                        self._output_tokens_by_priority.setdefault(request.priority, RecentMean(30.0)).observe(
                            out.num_output_tokens, now)
                    # Admission counts what it admitted on top of the last report until a newer
                    # one arrives: report the freed capacity before the caller can send more.
                    await self.publish_load()
                chunk = token_chunk(out, index, self.worker_id)
                if index == 0:
                    if local_only:
                        self.num_local_only_prompt_tokens += len(request.prompt_token_ids) - out.num_cached_tokens
                    chunk = chunk.model_copy(update={"phases": self._first_token_phases(
                        started, now, out.first_scheduled_time, handle)})
                yield chunk
                index += 1
        except InvalidRequestError as exc:
            raise ServiceError("bad_request", str(exc), getattr(exc, "field", None)) from None
        except (EngineError, ValueError) as exc:
            raise ServiceError("rejected", str(exc)) from None
        finally:
            self.origins.remove(request)
            self._running.discard(request.request_id)
            self._cancelled.discard(request.request_id)
        log.debug("%s done in %.3fs", request.request_id, time.monotonic() - started)

    @staticmethod
    def _first_token_phases(received_at: float, first_output_at: float, scheduled_at: float | None,
                            handle: RemotePrefill | None) -> dict[str, float]:
        """The request's phases until its first token, each also a span of its trace."""
        remote = handle.times() if handle is not None else None
        phases = worker_phases(received_at, first_output_at, scheduled_at=scheduled_at, remote=remote)
        at = received_at
        for name, seconds in phases.items():
            if remote is None or name not in ("prefill_queue", "prefill"):  # the prefill worker's spans
                tracing.record_span(f"decode.{name}", at, at + seconds)
            at += seconds
        tracing.add_event("first_token")
        return phases

    async def cancel(self, request: CancelRequest) -> None:
        log.info("cancel %s: %s", request.request_id, request.reason)
        if request.request_id in self._running:
            self._cancelled.add(request.request_id)
        self.engine.abort(request.request_id)
        if self.remote is not None:
            self.remote.cancel(request.request_id)

    async def _abort_orphan(self, request_id: str, reason: str) -> None:
        await self.cancel(CancelRequest(request_id=request_id, reason=reason))

    async def control(self, request: ControlRequest) -> ControlResult:
        if request.action == "configure":
            changes = {k: v for k in ("max_local_prefill_tokens", "max_prefill_queue")
                       if (v := getattr(request, k)) is not None}
            if changes and self.remote is None:
                raise ServiceError("bad_request", f"worker {self.worker_id} has remote prefill off")
            if changes:
                log.info("disaggregation thresholds now %s", self.remote.configure(**changes))
        thresholds = dataclasses.asdict(self.remote.config) if self.remote is not None else {}
        holds = None if request.request_id is None else request.request_id in self._running
        return ControlResult(worker_id=self.worker_id, state=self.state, num_in_flight=self._bus.num_in_flight,
                             holds_request=holds, **thresholds)

    def load(self) -> WorkerLoad:
        transfer = next((r.transfer for r in (self.remote, self.fetcher) if r is not None), None)
        return self._load(
            ttft_recent_s=self._ttft.mean(), itl_recent_s=self._itl.mean(), itl_recent_batch=self._itl_batch.mean(),
            output_tokens_recent=self._output_tokens.mean(),
            output_tokens_recent_by_priority={p: m for p, r in self._output_tokens_by_priority.items()
                                              if (m := r.mean()) is not None},
            num_requests_total=self.num_requests_total, num_requests_aborted=self.num_requests_aborted,
            num_local_prefills=self.num_local_prefills,
            num_local_only_prompt_tokens_total=self.num_local_only_prompt_tokens,
            num_remote_prefills=self.remote.num_remote if self.remote else 0,
            num_prefill_fallbacks=self.remote.num_fallbacks if self.remote else 0,
            kv_bytes_received=transfer.stats.num_bytes_received if transfer else 0,
            kv_bytes_sent=transfer.stats.num_bytes_sent if transfer else 0,
            kv_fetch=KvFetchLoad(**dataclasses.asdict(self.fetcher.counters)) if self.fetcher else None)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Stay listed as ``draining`` (admission skips it) while in-flight requests finish; the
        KV poller runs until then (remote prefills in flight wait on it)."""
        self.state = "draining"
        await self._registry.put(self.info())
        log.info("draining %d in-flight requests", self._bus.num_in_flight)
        num_left = await self._bus.stop_serving(self._settings.drain_timeout_s if timeout_s is None else timeout_s)
        if num_left:
            log.warning("drain timeout: %d requests cut off", num_left)
        if self.fetcher is not None:
            await self.fetcher.release_quarantine()
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)

