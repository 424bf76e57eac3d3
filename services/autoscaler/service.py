"""autoscaler: the cluster view — registry plus latest load of every worker — served on the
cluster-status subject for the gateway's ``/status``; and, with ``--autoscale``, every tick the
policy's decision on the prefill/decode split, carried out by flipping workers over their control
subjects (``shared.cluster.scaling`` decides; this module only reads and sends)."""

from __future__ import annotations

import asyncio
import logging
import time

from shared.bus import Bus, ServiceError, WorkerRegistry
from shared.cluster.scaling import Autoscaling, ScalingPlan
from shared.cluster.view import ClusterView
from shared.disagg.prefill_queue import prefill_queue_levels
from shared.policy.autoscale import RatioAutoscaler
from shared.policy.autoscale_inputs import Flip
from shared.policy.fleet import FleetAutoscaler
from shared.protocol import (ClusterStatusRequest, ClusterStatusResult, ControlRequest, PrefillQueueStatus,
                             ScaleRequest, ScalingAction, Subjects, WorkerLoad)
from services.framework.lifecycle import every, run_bus_service, service_instance_id
from shared.telemetry.families import AutoscalerMetrics
from services.autoscaler.config import AutoscalerSettings

log = logging.getLogger(__name__)


class AutoscalerService:
    def __init__(self, settings: AutoscalerSettings, bus: Bus, registry: WorkerRegistry) -> None:
        self._settings = settings
        self._subjects = Subjects(settings.namespace)
        self._bus = bus
        self._registry = registry
        self.view = ClusterView()
        fleet = settings.fleet_config()
        self.scaling = Autoscaling(RatioAutoscaler(settings.autoscale_config()), settings.capacities(),
                                   window_s=settings.autoscale_window_s,
                                   fleet=FleetAutoscaler(fleet) if fleet is not None else None)
        self.metrics = AutoscalerMetrics.create(service_instance_id("autoscaler"), settings.num_restarts)
        self.metrics.bind(lambda: self.view.status(time.time()).workers)

    async def start(self) -> None:
        self.view.set_workers(await self._registry.list())
        await self._bus.subscribe(self._subjects.load_all(), self.on_load)
        await self._bus.serve(self._subjects.cluster_status(), self.status, queue="autoscaler")

    async def on_load(self, load: WorkerLoad) -> None:
        self.view.update_load(load, time.time())

    async def status(self, request: ClusterStatusRequest) -> ClusterStatusResult:
        result = self.view.status(time.time()).model_copy(
            update={"scaling": self.scaling.status(self._settings.autoscale)})
        queue = await self._prefill_queue()
        return result if queue is None else result.model_copy(update={"prefill_queue": queue})

    async def _prefill_queue(self) -> PrefillQueueStatus | None:
        levels = await prefill_queue_levels(self._bus, self._subjects)
        if levels is None:
            return None
        return PrefillQueueStatus(num_pending=sum(c.num_pending for c in levels),
                                  num_ack_pending=sum(c.num_ack_pending for c in levels),
                                  num_redelivered=sum(c.num_redelivered for c in levels),
                                  num_waiting_pulls=sum(c.num_waiting for c in levels),
                                  num_pending_by_level=[c.num_pending for c in levels])

    async def refresh(self) -> None:
        self.view.set_workers(await self._registry.list())
        if (queue := await self._prefill_queue()) is not None:  # for the metrics: the gauges stay current
            self.metrics.observe_queue(queue.num_pending_by_level, queue.num_ack_pending, queue.num_redelivered)

    async def tick(self) -> ScalingPlan:
        """Decide on fresh registry states, flip the chosen workers, record what happened."""
        await self.refresh()
        now = time.time()
        plan = self.scaling.plan(now, self.view.status(now).workers)
        log.info("scaling: %s", plan.describe())
        actions = [await self._flip(f) for f in plan.flips]
        if plan.start is not None or plan.stop is not None:
            actions.append(await self._scale(plan))
        record = self.scaling.record(plan, actions)
        self.metrics.observe_decision(record or self.scaling.status(True).last_decision, actions)
        return plan

    async def _scale(self, plan: ScalingPlan) -> ScalingAction:
        """Ask tandem up (the owner of the worker processes) to start or stop one."""
        if plan.start is not None:
            request = ScaleRequest(action="start", role=plan.start, reason=plan.reason)
        else:
            request = ScaleRequest(action="stop", role=plan.stop.to_role, worker_id=plan.stop.worker_id,
                                   reason=plan.reason)
        try:
            result = await self._bus.request(self._subjects.fleet_scale(), request,
                                             timeout_s=self._settings.control_timeout_s)
        except ServiceError as exc:
            log.warning("%s of a %s worker refused: %s", request.action, request.role, exc.message)
            return ScalingAction(kind=request.action, worker_id=request.worker_id, role=request.role, ok=False,
                                 message=exc.message)
        if request.action == "start":
            self.scaling.started(result.worker_id, time.time())
        return ScalingAction(kind=request.action, worker_id=result.worker_id, role=request.role, ok=True,
                             message=f"pid {result.pid}" if result.pid else "draining")

    async def _flip(self, flip: Flip) -> ScalingAction:
        try:
            result = await self._bus.request(self._subjects.control(flip.worker_id),
                                             ControlRequest(action="flip", role=flip.to_role),
                                             timeout_s=self._settings.control_timeout_s)
        except ServiceError as exc:
            log.warning("flip of %s to %s refused: %s", flip.worker_id, flip.to_role, exc.message)
            return ScalingAction(kind="flip", worker_id=flip.worker_id, role=flip.to_role, ok=False,
                                 message=exc.message)
        return ScalingAction(kind="flip", worker_id=flip.worker_id, role=flip.to_role, ok=True,
                             message=f"{result.state}, {result.num_in_flight} in flight")

    async def run_forever(self) -> None:
        loops = [every(self._settings.refresh_interval_s, self.refresh, "registry refresh")]
        if self._settings.autoscale:
            loops.append(every(self._settings.autoscale_interval_s, self.tick, "autoscaling tick"))
        await asyncio.gather(*loops)


async def run(settings: AutoscalerSettings, stop: asyncio.Event) -> None:
    await run_bus_service("autoscaler", settings, stop,
                          lambda bus, registry: AutoscalerService(settings, bus, registry))
