"""autoscaler (first version): the cluster view — registry plus latest load of every worker —
served on the cluster-status subject for the gateway's ``/status``. Scaling policy comes later."""

from __future__ import annotations

import asyncio
import logging
import time

from shared.bus import Bus, WorkerRegistry
from shared.cluster.view import ClusterView
from shared.protocol import ClusterStatusRequest, ClusterStatusResult, PrefillQueueStatus, Subjects, WorkerLoad
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
        info = await self._bus.consumer_info(self._subjects.prefill_stream, self._subjects.prefill_consumer)
        if info is None:
            return result
        queue = PrefillQueueStatus(num_pending=info.num_pending, num_ack_pending=info.num_ack_pending,
                                   num_redelivered=info.num_redelivered, num_waiting_pulls=info.num_waiting)
        return result.model_copy(update={"prefill_queue": queue})

    async def refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._settings.refresh_interval_s)
            try:
                self.view.set_workers(await self._registry.list())
            except Exception as exc:  # noqa: BLE001
                log.warning("registry refresh failed: %s", exc)


async def run(settings: AutoscalerSettings, stop: asyncio.Event) -> None:
    bus = await Bus.connect(settings.nats_url, "autoscaler")
    try:
        registry = await WorkerRegistry.open(bus, Subjects(settings.namespace).workers_bucket,
                                             ttl_s=settings.registry_ttl_s, watch=True)
        service = AutoscalerService(settings, bus, registry)
        await service.start()
        refresher = asyncio.create_task(service.refresh_forever())
        log.info("autoscaler ready (namespace %s)", settings.namespace)
        await stop.wait()
        refresher.cancel()
        await bus.stop_serving(timeout_s=2)
    finally:
        await bus.close()
