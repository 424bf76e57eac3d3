"""admission: admit a request to a decode worker (KV overlap + load), or reject it.

Rejects with ``unavailable`` when no ready decode worker serves the model, ``overloaded`` when
every one's queue is at the limit. Asks kv-index for the prompt's prefix overlap with a short
timeout and routes on load alone when it does not answer.
"""

from __future__ import annotations

import asyncio
import logging
import time

from shared.bus import Bus, ServiceError, WorkerRegistry
from shared.cluster.view import ClusterView
from shared.policy.kv_routing import RoutingWeights, choose_worker
from shared.protocol import AdmissionDecision, GenerateRequest, KvMatchRequest, Subjects, WorkerLoad
from shared.runtime.service import every, run_bus_service
from services.admission.config import AdmissionSettings

log = logging.getLogger(__name__)


class AdmissionService:
    def __init__(self, settings: AdmissionSettings, bus: Bus, registry: WorkerRegistry) -> None:
        self._settings = settings
        self._subjects = Subjects(settings.namespace)
        self._bus = bus
        self._registry = registry
        self.view = ClusterView()
        self._weights = RoutingWeights(overlap_weight=settings.overlap_weight,
                                       queue_weight=settings.queue_weight,
                                       max_waiting_per_worker=settings.max_waiting_per_worker)

    async def start(self) -> None:
        await self.refresh()
        await self._bus.subscribe(self._subjects.load_all(), self.on_load)
        await self._bus.serve(self._subjects.admission_submit(), self.submit, queue="admission")

    async def refresh(self) -> None:
        self.view.set_workers(await self._registry.list())

    async def run_forever(self) -> None:
        await every(self._settings.refresh_interval_s, self.refresh, "registry refresh")

    async def on_load(self, load: WorkerLoad) -> None:
        self.view.update_load(load, time.time())

    async def submit(self, request: GenerateRequest) -> AdmissionDecision:
        workers = self.view.ready_workers("decode", request.model)
        if not workers:
            await self.refresh()  # a worker may have registered since the last refresh
            workers = self.view.ready_workers("decode", request.model)
        if not workers:
            return self._reject(request, "unavailable", f"no ready decode worker serves {request.model!r}")
        block_size = workers[0].info.block_size
        num_blocks = -(-len(request.prompt_token_ids) // block_size)  # ceil
        overlaps = await self._overlaps(request)
        now = time.time()
        views = [w.load_view(now) for w in workers]
        choice = choose_worker(views, overlaps, num_blocks, self._weights)
        if choice.worker_id is None:
            return self._reject(request, "overloaded",
                                f"all {len(workers)} decode workers have "
                                f"{self._settings.max_waiting_per_worker}+ queued requests")
        log.debug("%s → %s (cost %.1f, overlap %d/%d blocks; overlaps %s; loads %s)", request.request_id,
                  choice.worker_id, choice.cost, choice.num_overlap_blocks, num_blocks, overlaps,
                  views)
        self.view.note_admitted(choice.worker_id, num_blocks - choice.num_overlap_blocks, time.time())
        info = self.view.get(choice.worker_id).info
        return AdmissionDecision(request_id=request.request_id, is_admitted=True,
                                 worker_id=info.worker_id, generate_subject=info.generate_subject,
                                 cancel_subject=info.cancel_subject,
                                 num_overlap_blocks=choice.num_overlap_blocks)

    async def _overlaps(self, request: GenerateRequest) -> dict[str, int]:
        if not request.block_hashes:
            return {}
        try:
            result = await self._bus.request(self._subjects.kvindex_match(),
                                             KvMatchRequest(block_hashes=request.block_hashes),
                                             timeout_s=self._settings.kv_match_timeout_s)
        except ServiceError as exc:
            log.warning("kv-index did not answer (%s): routing on load only", exc.message)
            return {}
        return {o.worker_id: o.num_blocks for o in result.overlaps}

    def _reject(self, request: GenerateRequest, reason, message: str) -> AdmissionDecision:
        log.info("rejecting %s: %s", request.request_id, message)
        return AdmissionDecision(request_id=request.request_id, is_admitted=False,
                                 reject_reason=reason, message=message,
                                 retry_after_s=self._settings.retry_after_s)


async def run(settings: AdmissionSettings, stop: asyncio.Event) -> None:
    await run_bus_service("admission", settings, stop,
                          lambda bus, registry: AdmissionService(settings, bus, registry))
