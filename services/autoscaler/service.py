"""autoscaler (first version): the cluster view — registry plus latest load of every worker —
served on the cluster-status subject for the gateway's ``/status``. Scaling policy comes later."""

from __future__ import annotations

import asyncio
import logging
import time

from shared.bus import Bus, WorkerRegistry
from shared.cluster.view import ClusterView
from shared.protocol import ClusterStatusRequest, ClusterStatusResult, PrefillQueueStatus, Subjects, WorkerLoad
from shared.runtime.service import every, run_bus_service
from services.autoscaler.config import AutoscalerSettings

log = logging.getLogger(__name__)


class AutoscalerService:
    def __init__(self, settings: AutoscalerSettings, bus: Bus, registry: WorkerRegistry) -> None:
        self._settings = settings
        self._subjects = Subjects(settings.namespace)
        self._bus = bus
        self._registry = registry
        self.view = ClusterView()

    async def start(self) -> None:
        self.view.set_workers(await self._registry.list())
        await self._bus.subscribe(self._subjects.load_all(), self.on_load)
        await self._bus.serve(self._subjects.cluster_status(), self.status, queue="autoscaler")

    async def on_load(self, load: WorkerLoad) -> None:
        self.view.update_load(load, time.time())

    async def status(self, request: ClusterStatusRequest) -> ClusterStatusResult:
        result = self.view.status(time.time())
        s = self._subjects
        levels = [await self._bus.consumer_info(s.prefill_stream, name) for name in s.prefill_consumers()]
        if None in levels:
            return result
        queue = PrefillQueueStatus(num_pending=sum(c.num_pending for c in levels),
                                   num_ack_pending=sum(c.num_ack_pending for c in levels),
                                   num_redelivered=sum(c.num_redelivered for c in levels),
                                   num_waiting_pulls=sum(c.num_waiting for c in levels),
                                   num_pending_by_level=[c.num_pending for c in levels])
        return result.model_copy(update={"prefill_queue": queue})

    async def refresh(self) -> None:
        self.view.set_workers(await self._registry.list())

    async def run_forever(self) -> None:
        await every(self._settings.refresh_interval_s, self.refresh, "registry refresh")


async def run(settings: AutoscalerSettings, stop: asyncio.Event) -> None:
    await run_bus_service("autoscaler", settings, stop,
                          lambda bus, registry: AutoscalerService(settings, bus, registry))
