"""``tandem up``'s side of autoscaling: it owns the worker processes, so it serves the fleet-scale
subject and does what the autoscaler asks (the autoscaler decides; this only executes).

``start``: a new worker process of the asked role, under a fresh name. ``stop``: the worker is
marked retired in the stack (its exit is expected), then asked over its control subject to drain
with ``drain_timeout_s`` — long, so that what it holds finishes rather than being cut off — and
leave; it deregisters, exits 0, and the supervisor does not restart a clean exit.

The stack is synchronous (threads); this runs its own event loop in a thread for its one NATS
connection.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Protocol

from services.stack.children import Child
from shared.bus import Bus, ServiceError
from shared.protocol import ControlRequest, ScaleRequest, ScaleResult, Subjects

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 10.0


class _Namespaced(Protocol):
    namespace: str


class WorkerProcesses(Protocol):
    """What the fleet manager asks of the owner of the worker processes (``services.stack.stack.Stack``;
    a Protocol, so that the stack imports this module and not the other way round)."""

    spec: _Namespaced
    nats_url: str
    nats_ca: str | None
    nats_replicas: int | None

    def add_worker(self, role: str) -> tuple[str, str, Child]:
        """Start a worker of ``role`` under a fresh name: (name, worker id, its child process)."""

    def worker_name(self, worker_id: str) -> str | None:
        """The name of this stack's worker ``worker_id``; None if it has none."""

    def retire(self, name: str, is_retired: bool = True) -> None:
        """Mark worker ``name`` as leaving on purpose (its exit is no crash), or undo that."""

    def log_line(self, line: str) -> None:
        """Print one line of the stack's log."""


class FleetManager:
    def __init__(self, stack: WorkerProcesses, *, drain_timeout_s: float) -> None:
        self._stack = stack
        self._drain_timeout_s = drain_timeout_s
        self._subjects = Subjects(stack.spec.namespace)
        self._bus: Bus | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._serving = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fleet", daemon=True)

    def start(self, timeout_s: float = 60.0) -> None:
        """Serve the fleet-scale subject; returns once it is served."""
        self._thread.start()
        if not self._serving.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"fleet manager did not start serving in {timeout_s:g}s: {self._error}")

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 — reported by start(), or logged once serving
            self._error = exc
            self._serving.set()
            log.exception("fleet manager stopped")

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._bus = await Bus.connect(self._stack.nats_url, "up-fleet", tls_ca=self._stack.nats_ca,
                                      replicas=self._stack.nats_replicas)
        try:
            await self._bus.serve(self._subjects.fleet_scale(), self.scale)
            await self._bus.flush()
            self._serving.set()
            await self._stop.wait()
        finally:
            await self._bus.close()

    async def scale(self, request: ScaleRequest) -> ScaleResult:
        if request.action == "start":
            name, worker_id, child = await asyncio.to_thread(self._stack.add_worker, request.role)
            self._stack.log_line(f"scale up: started {name} ({request.role}, pid {child.pid}): {request.reason}")
            return ScaleResult(worker_id=worker_id, pid=child.pid)
        name = self._stack.worker_name(request.worker_id)
        if name is None:
            raise ServiceError("not_found", f"no worker {request.worker_id} in this stack")
        self._stack.retire(name)
        try:
            await self._bus.request(self._subjects.control(request.worker_id),
                                    ControlRequest(action="stop", drain_timeout_s=self._drain_timeout_s),
                                    timeout_s=CONTROL_TIMEOUT_S)
        except ServiceError:
            self._stack.retire(name, False)  # it did not hear: still one of the fleet, still supervised
            raise
        self._stack.log_line(f"scale down: {name} draining, then exiting: {request.reason}")
        return ScaleResult(worker_id=request.worker_id)
