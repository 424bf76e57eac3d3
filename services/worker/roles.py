"""One engine process serving one role at a time (decode or prefill), and flipping between them
without reloading weights.

The process owns what outlives a role: the engine (weights, KV pool, prefix cache), the NATS
connection that carries its control subject, registry heartbeat, load reports and KV events, and
the load-report sequence. A role owns what it serves: its own connection (so stopping its
subscriptions leaves the control subject up) and its loops.

A flip (``ControlRequest(action="flip", role=...)``) is answered at once; then the current role
drains exactly as for a shutdown (listed ``draining``, so admission routes nothing new to it; it
takes no new work and finishes what it holds, up to its drain timeout), its connection closes, and
the new role starts on the same engine and registers ``ready`` under the same worker id. A decode
worker's requests in flight are finished where they are, not migrated: their KV is here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from shared.bus import Bus, ServiceError, WorkerRegistry
from shared.kvcache.events import SequencedEvent
from shared.protocol import ControlRequest, ControlResult, Subjects, WorkerInfo, WorkerLoad
from shared.protocol.workers import Role

log = logging.getLogger(__name__)


class RoleWorker(Protocol):
    role: Role
    state: str

    def info(self) -> WorkerInfo:
        """The registry entry as of now (role, state, subjects)."""

    def load(self) -> WorkerLoad:
        """A load report; takes the next number of the process's load sequence."""

    async def start(self) -> None:
        """Serve the role's subjects on its connection, start its loops, register as ready."""

    async def control(self, request: ControlRequest) -> ControlResult:
        """``configure`` and ``status`` (the process handles ``drain``, ``stop`` and ``flip``)."""

    async def drain(self, timeout_s: float | None = None) -> None:
        """Listed as ``draining``; take no new work; finish what is in flight (up to ``timeout_s``,
        default the role's drain timeout: what is left is cut off); stop the role's loops. Stays
        registered."""


class RoleFactory(Protocol):
    def check(self, role: Role) -> None:
        """Raise ``ServiceError`` if this process cannot serve ``role`` (before anything drains)."""

    async def make(self, role: Role, bus: Bus, load_seq: itertools.count) -> RoleWorker:
        """A new, not yet started role on ``bus`` (the role's own connection)."""


class RoleRunner:
    def __init__(self, worker_id: str, *, bus: Bus, registry: WorkerRegistry, subjects: Subjects,
                 factory: RoleFactory, connect: Callable[[str], Awaitable[Bus]], load_interval_s: float,
                 on_load: Callable[[WorkerLoad, str], None] | None = None) -> None:
        self.worker_id = worker_id
        self.role: RoleWorker | None = None
        self._bus = bus
        self._registry = registry
        self._subjects = subjects
        self._factory = factory
        self._connect = connect  # a new connection, named
        self._load_interval_s = load_interval_s
        self._on_load = on_load  # each periodic load report and the role's state (the metrics read it)
        self._role_bus: Bus | None = None
        self._load_seq = itertools.count(1)
        self._flip_to: Role | None = None
        self._is_leaving = False
        self._leave_timeout_s: float | None = None  # a stop's own drain timeout (a scale-down's)
        self._wake = asyncio.Event()
        self.num_flips = 0

    # -- control ----------------------------------------------------------------------------------
    async def control(self, request: ControlRequest) -> ControlResult:
        if self.role is None:
            raise ServiceError("rejected", f"worker {self.worker_id} is starting")
        if request.action == "flip":
            self._request_flip(request.role)
        elif request.action in ("drain", "stop"):
            self._is_leaving = True
            self._leave_timeout_s = request.drain_timeout_s
            self._wake.set()
        result = await self.role.control(ControlRequest(action="status") if request.action in (
            "flip", "drain", "stop") else request)
        busy = self._is_leaving or self._flip_to is not None
        return result.model_copy(update={"state": "draining" if busy else result.state,
                                         "role": self.role.role, "flipping_to": self._flip_to})

    def _request_flip(self, role: Role) -> None:
        if self._is_leaving:
            raise ServiceError("rejected", f"worker {self.worker_id} is leaving")
        if self._flip_to is not None and self._flip_to != role:
            raise ServiceError("rejected", f"worker {self.worker_id} is already flipping to {self._flip_to}")
        if self._flip_to is None and role == self.role.role:
            return  # already serving it: nothing to do (a repeated request is harmless)
        self._factory.check(role)
        self._flip_to = role
        self._wake.set()

    # -- life ---------------------------------------------------------------------------------------
    async def run(self, first: Role, stop: asyncio.Event, *, warm_up: Callable[[RoleWorker], Awaitable[None]],
                  kv_events: asyncio.Queue[SequencedEvent],
                  publish_kv_events: Callable[[asyncio.Queue[SequencedEvent]], Awaitable[None]]) -> None:
        """Serve ``first``, flip as asked, and return (deregistered) once ``stop`` is set or a
        drain was asked for."""
        tasks: list[asyncio.Task] = []
        try:
            role = await self._make(first)
            await warm_up(role)
            await self._bus.serve(self._subjects.control(self.worker_id), self.control)
            await role.start()
            heartbeat = asyncio.create_task(self._registry.heartbeat(lambda: self.role.info()))
            stopping = asyncio.create_task(stop.wait())
            tasks = [heartbeat, stopping, *(asyncio.create_task(c) for c in (
                self._publish_load_forever(), publish_kv_events(kv_events)))]
            while True:
                woken = asyncio.create_task(self._wake.wait())
                await asyncio.wait([stopping, woken], return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                self._wake.clear()
                if stop.is_set() or self._is_leaving:
                    break
                if self._flip_to is not None:
                    await self._flip(self._flip_to)
            log.info("draining %s", self.role.role)
            await self._drain_role(self._leave_timeout_s)
            heartbeat.cancel()  # no beat may re-register us after the delete
            await asyncio.gather(heartbeat, return_exceptions=True)
            await self._registry.delete(self.worker_id)
        finally:
            for task in tasks:
                task.cancel()
            if self._role_bus is not None:
                await self._role_bus.close()

    async def _make(self, role: Role) -> RoleWorker:
        self._role_bus = await self._connect(f"{self.worker_id}-{role}")
        self.role = await self._factory.make(role, self._role_bus, self._load_seq)
        return self.role

    async def _drain_role(self, timeout_s: float | None = None) -> None:
        await self.role.drain(timeout_s)
        await self._role_bus.close()
        self._role_bus = None

    async def _flip(self, target: Role) -> None:
        old = self.role.role
        log.info("flip to %s: draining the %s role", target, old)
        await self._drain_role()
        try:
            await (await self._make(target)).start()
        except Exception:  # noqa: BLE001 — serve the old role again rather than nothing
            log.exception("starting the %s role failed: serving as %s again", target, old)
            if self._role_bus is not None:
                await self._role_bus.close()
            await (await self._make(old)).start()
        else:
            self.num_flips += 1
            log.info("flip done: serving as %s (same engine, no reload)", target)
        finally:
            self._flip_to = None

    async def _publish_load_forever(self) -> None:
        while True:
            role = self.role
            try:
                load = role.load()
                if self._on_load is not None:
                    self._on_load(load, role.state)
                await self._bus.publish(self._subjects.load(role.role, self.worker_id), load)
            except Exception as exc:  # noqa: BLE001 — reconnecting: the next report will do
                log.warning("load report failed: %s", exc)
            await asyncio.sleep(self._load_interval_s)
