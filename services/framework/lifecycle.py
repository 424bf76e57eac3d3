"""Running a service process: logging, signals, and one asyncio loop until told to stop; and the
lifecycle every bus service shares (connect, open the registry, start, periodic work, wait for
stop, finish what is in flight, close)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Protocol

from prometheus_client import CollectorRegistry

from services.framework.settings import ServiceSettings
from shared import __version__
from shared.bus import Bus, ServiceDirectory, WorkerRegistry
from shared.openai_api.auth import read_operator_key
from shared.protocol import ServiceInfo, Subjects
from shared.telemetry.logs import configure_logging
from shared.telemetry.metrics import metrics_site
from shared.telemetry.tracing import configure_tracing, service_name

log = logging.getLogger(__name__)


def run_service(name: str, level: str, main: Callable[[asyncio.Event], Awaitable[None]], *,
                log_format: str | None = None) -> int:
    """Run ``main(stop)``; SIGTERM and SIGINT set ``stop`` (a second one exits at once). Tracing
    is set up here, once per process, from the ``OTEL_*`` variables."""
    configure_logging(name, level, log_format)
    if configure_tracing(name):
        log.info("tracing on: spans of %s exported over OTLP", service_name(name, os.environ))

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            if stop.is_set():
                log.warning("second %s: exiting now", signal.Signals(signum).name)
                raise SystemExit(1)
            log.info("%s: stopping", signal.Signals(signum).name)
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        await main(stop)

    try:
        asyncio.run(runner())
    except ConnectionError as exc:  # a server we need is unreachable: a clear line, not a traceback
        log.error("%s", exc)
        return getattr(exc, "exit_code", 1)  # NATS's cause, told apart (shared.bus.errors)
    return 0


STOP_SERVING_TIMEOUT_S = 2.0  # requests in flight at shutdown get this long to finish


class HasMetrics(Protocol):
    registry: CollectorRegistry


class BusService(Protocol):
    metrics: HasMetrics  # its Prometheus families, served on the metrics port

    async def start(self) -> None:
        """Subscribe and serve; return once requests are being answered."""

    async def run_forever(self) -> None:
        """The service's periodic work (registry refresh, sweeps); runs until cancelled at stop."""


@asynccontextmanager
async def bus_connection(name: str, settings: ServiceSettings) -> AsyncIterator[tuple[Bus, WorkerRegistry]]:
    """The bus, connected as ``name``, and the namespace's worker registry (watched). Leaving the
    block normally gives the requests in flight ``STOP_SERVING_TIMEOUT_S`` to finish; the bus is
    closed either way. The process enters the service directory with ``published_metrics``."""
    bus = await Bus.connect(settings.nats_url, name, tls_ca=settings.nats_ca, replicas=settings.nats_replicas)
    try:
        registry = await WorkerRegistry.open(bus, Subjects(settings.namespace).workers_bucket,
                                             ttl_s=settings.registry_ttl_s, watch=True)
        yield bus, registry
        await bus.stop_serving(timeout_s=STOP_SERVING_TIMEOUT_S)
    finally:
        await bus.close()


async def serve_until_stopped(name: str, service: BusService, stop: asyncio.Event, namespace: str) -> None:
    """Start ``service``, run its periodic work beside it, and return when ``stop`` is set."""
    await service.start()
    background = asyncio.create_task(service.run_forever())
    log.info("%s ready (namespace %s)", name, namespace)
    try:
        await stop.wait()
    finally:
        background.cancel()


async def run_bus_service(name: str, settings: ServiceSettings, stop: asyncio.Event,
                          make: Callable[[Bus, WorkerRegistry], BusService]) -> None:
    """The whole life of a service that needs only the bus and the registry."""
    async with bus_connection(name, settings) as (bus, registry):
        service = make(bus, registry)
        async with published_metrics(name, service_instance_id(name), settings, bus, service.metrics.registry):
            await serve_until_stopped(name, service, stop, settings.namespace)


def service_instance_id(service: str) -> str:
    """This process's key in the service directory (several replicas of a service may run)."""
    return f"{service}-{socket.gethostname()}-{os.getpid()}"[:128].replace(":", "-")


@asynccontextmanager
async def published_metrics(service: str, instance_id: str, settings: ServiceSettings, bus: Bus,
                            registry: CollectorRegistry) -> AsyncIterator[str]:
    """Serve ``registry`` on the metrics port and keep its address in the service directory for
    the block (removed at the end); yields the URL."""
    key = read_operator_key(settings.metrics_key_file, "metrics_key_file") if settings.metrics_key_file else None
    async with metrics_site(registry, settings.metrics_host, settings.metrics_port, key) as url:
        log.info("metrics on %s", url)
        directory = await ServiceDirectory.open(bus, Subjects(settings.namespace).services_bucket,
                                                ttl_s=settings.registry_ttl_s)
        info = ServiceInfo(instance_id=instance_id, service=service, metrics_url=url, host=socket.gethostname(),
                           pid=os.getpid(), started_at=time.time(), num_restarts=settings.num_restarts,
                           version=__version__)
        beat = asyncio.create_task(directory.heartbeat(lambda: info))
        try:
            yield url
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)
            try:
                await directory.delete(instance_id)
            except Exception as exc:  # noqa: BLE001 — the TTL removes it anyway
                log.warning("leaving the service directory failed: %s", exc)


async def every(interval_s: float, work: Callable[[], Awaitable[object]], what: str) -> None:
    """Run ``work`` now and then every ``interval_s`` until cancelled. A failed round is logged and
    the next one tries again: NATS reconnecting or Redis restarting must not end the loop."""
    while True:
        try:
            await work()
        except Exception as exc:  # noqa: BLE001 — keep the last state until the next round
            log.warning("%s failed: %r", what, exc)
        await asyncio.sleep(interval_s)
