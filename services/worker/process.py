"""A worker process (``tandem decode`` or ``tandem prefill``): load the model once, then serve the
role it was started as, or the other one after a flip (``services.worker.roles``). The roles come
in as ``RoleBuilder``s (``services.worker.role_builder``) from the command that starts the process:
this module imports neither role package.

The settings of the role a process was not started as are its engine settings (model, device, KV
budget, worker id, timeouts...) with that role's own fields at their defaults (or ``TANDEM_``
environment values). The NIXL agent is opened once, over the one KV pool, and serves both roles:
a decode role is written into, a prefill role writes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Mapping

from shared.bus import Bus, ServiceError, WorkerRegistry
from shared.engine import AsyncEngine
from shared.protocol import Subjects
from shared.protocol.workers import Role
from services.framework.lifecycle import published_metrics
from shared.transfer import TransferUnavailable
from services.worker.compile_share import NatsArtifactStore
from services.worker.engine_worker import publish_kv_events_forever, start_kv_events
from services.worker.metrics import WorkerMetrics
from services.worker.role_builder import RoleBuilder, RoleParts
from services.worker.roles import RoleRunner, RoleWorker
from services.worker.settings import EngineWorkerSettings

log = logging.getLogger(__name__)


def role_of(settings: EngineWorkerSettings, builders: Mapping[Role, RoleBuilder]) -> Role:
    return next(role for role, builder in builders.items() if isinstance(settings, builder.settings_class))


def settings_for(settings: EngineWorkerSettings, cls: type[EngineWorkerSettings]) -> EngineWorkerSettings:
    """``settings`` if they are a ``cls``, else ``cls`` settings sharing their engine fields."""
    if isinstance(settings, cls):
        return settings
    common = settings.model_dump(include={*EngineWorkerSettings.model_fields, "worker_id"})
    return cls(**common)


class WorkerRoles:
    """Builds the roles of one process around its engine; opens the KV transfer when a role first
    needs it (a prefill role always, a decode role if remote prefill or prefix fetch is on)."""

    def __init__(self, settings: EngineWorkerSettings, engine: AsyncEngine, bus: Bus,
                 registry: WorkerRegistry, metrics: WorkerMetrics | None = None,
                 builders: Mapping[Role, RoleBuilder] | None = None) -> None:
        self._settings = settings
        self._builders = builders or {}  # none: the process can open its transfer but build no role
        self._metrics = metrics
        self._engine = engine
        self._bus = bus
        self._registry = registry
        self._subjects = Subjects(settings.namespace)
        self.transfer = None
        self.store = None
        self.transfer_error: str | None = None

    def check(self, role: Role) -> None:
        if role == "prefill" and self.open_transfer() is None:
            raise ServiceError("rejected", f"cannot serve prefill without a KV transfer: {self.transfer_error}")

    async def make(self, role: Role, bus: Bus, load_seq: itertools.count) -> RoleWorker:
        builder = self._builders[role]
        settings = settings_for(self._settings, builder.settings_class)
        transfer = self.open_transfer() if builder.wants_transfer(settings) else None
        if role == "prefill" and transfer is None:
            raise TransferUnavailable(self.transfer_error or "no KV transfer")
        if transfer is not None:
            await self._publish_metadata()
        return builder.build(settings, RoleParts(bus=bus, registry=self._registry, engine=self._engine,
                                                 subjects=self._subjects, load_seq=load_seq, metrics=self._metrics,
                                                 transfer=transfer, store=self.store))

    def open_transfer(self):
        """The process's NIXL agent over its KV pool; None (the reason kept) where NIXL cannot run."""
        # a group: its ranks' processes on this host or another (rank_pids lists this host's only)
        is_group = self._engine is not None and self._engine.tensor_parallel_size * \
            self._engine.pipeline_parallel_size > 1
        if self.transfer is None and self.transfer_error is None and is_group:
            self._open_group_transfer()
        if self.transfer is None and self.transfer_error is None:
            from shared.transfer.nixl import NixlTransfer

            try:
                transfer = NixlTransfer(self._settings.worker_id)
            except TransferUnavailable as exc:
                log.warning("remote prefill OFF: %s (this worker cannot flip to prefill either)", exc)
                self.transfer_error = str(exc)
                return None
            transfer.register_kv_pool(self._engine.kv_cache, self._engine.kv_spec)
            self.transfer = transfer
        return self.transfer

    def _open_group_transfer(self) -> None:
        """A parallel worker: every rank's agent over its shard (made in the engine thread, where
        rank 0 talks to the others), driven through ``GroupTransfer``."""
        from shared.transfer.group import GroupTransfer

        try:
            rank0, metadata = self._engine.open_group_transfer(self._settings.worker_id).result(timeout=120)
        except TransferUnavailable as exc:
            log.warning("remote prefill OFF: %s (this worker cannot flip to prefill either)", exc)
            self.transfer_error = str(exc)
            return
        # a decode worker's own bound on its writes (a prefix it lends); a prefill worker's writes are
        # bounded by each request's write_timeout_s too, which the decode worker sets (2 s by default)
        self.transfer = GroupTransfer(rank0, metadata, self._engine.send_group_kv,
                                      write_timeout_s=getattr(self._settings, "kv_write_timeout_s", 5.0))
        log.info("KV transfer: %d agents, one per rank (%s)", metadata.shape.size, metadata.shape.describe())

    async def _publish_metadata(self) -> None:
        """Prefill workers find this agent by worker id (decode role); a prefill role reads the
        others' from the same bucket."""
        from shared.transfer import publish_metadata
        from shared.transfer.nats_metadata import NatsMetadataStore

        if self.store is None:
            self.store = await NatsMetadataStore.open(self._bus, self._subjects.nixl_bucket)
            await publish_metadata(self.store, self._settings.worker_id, self.transfer)

    async def withdraw_metadata(self) -> None:
        if self.store is not None:
            try:
                await self.store.delete(self._settings.worker_id)
            except Exception as exc:  # noqa: BLE001 — a stale entry only costs a failed write
                log.warning("withdrawing NIXL metadata failed: %s", exc)


EXIT_ENGINE_DEAD = 70


def _exit_on_engine_death(exc: BaseException) -> None:
    """A broken engine (a step raised; on a tensor-parallel group, a rank died) serves nothing more:
    the worker exits at once, as a killed one would, so that its requests migrate, its registry
    entry lapses and its supervisor restarts it (the other ranks exit with it)."""
    log.critical("engine died (%s: %s): exiting", type(exc).__name__, exc)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(EXIT_ENGINE_DEAD)


async def run_worker(settings: EngineWorkerSettings, stop: asyncio.Event,
                     builders: Mapping[Role, RoleBuilder]) -> None:
    """Serve the role ``settings`` are of, one of ``builders`` (every role the process may flip to)."""
    role = role_of(settings, builders)
    bus = await Bus.connect(settings.nats_url, settings.worker_id, tls_ca=settings.nats_ca,
                            replicas=settings.nats_replicas)
    subjects = Subjects(settings.namespace)
    config = settings.engine_config()
    try:
        # the compiled decode step: loaded from the cluster where another worker compiled it
        store = await NatsArtifactStore.open(bus, subjects) if config.compile != "off" else None
        log.info("loading %s", settings.model)
        engine = await asyncio.to_thread(AsyncEngine.start, config, store, _exit_on_engine_death)
    except BaseException:
        await bus.close()
        raise
    roles = None
    try:
        registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=settings.registry_ttl_s, watch=True)
        metrics = WorkerMetrics.create(role, settings.worker_id, settings.num_restarts)
        engine.add_step_observer(metrics.observe_step)
        roles = WorkerRoles(settings, engine, bus, registry, metrics, builders)
        if role == "prefill" and roles.open_transfer() is None:  # a prefill worker is useless without it
            raise TransferUnavailable(f"a prefill worker needs a KV transfer: {roles.transfer_error}")
        events: asyncio.Queue = asyncio.Queue()

        async def warm_up(first: RoleWorker) -> None:
            await first.warm_up()
            await start_kv_events(bus, settings, engine, events)  # the warm-up's blocks are not announced

        runner = RoleRunner(settings.worker_id, bus=bus, registry=registry, subjects=subjects, factory=roles,
                            connect=lambda name: Bus.connect(settings.nats_url, name, tls_ca=settings.nats_ca,
                                                             replicas=settings.nats_replicas),
                            load_interval_s=settings.load_interval_s, on_load=metrics.observe_load)
        metrics.bind(engine.stats, lambda: roles.transfer.stats if roles.transfer is not None else None,
                     lambda: runner.num_flips)
        async with published_metrics(role, settings.worker_id, settings, bus, metrics.registry):
            await runner.run(role, stop, warm_up=warm_up, kv_events=events,
                             publish_kv_events=lambda q: publish_kv_events_forever(
                                 bus, subjects.kv_events(settings.worker_id), settings.worker_id, q))
    finally:
        if roles is not None:
            await roles.withdraw_metadata()
        await bus.close()
        await asyncio.to_thread(engine.shutdown)
        if roles is not None and roles.transfer is not None:
            roles.transfer.close()
        log.info("stopped")
