"""Running a service process: logging, signals, and one asyncio loop until told to stop; and the
lifecycle every bus service shares (connect, open the registry, start, periodic work, wait for
stop, finish what is in flight, close)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Protocol

from shared.bus import Bus, WorkerRegistry
from shared.protocol import Subjects
from shared.runtime.announce import announce_forever, open_services, this_service
from shared.runtime.settings import ServiceSettings
from shared.telemetry.logs import configure_logging
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
        return 1
    return 0


STOP_SERVING_TIMEOUT_S = 2.0  # requests in flight at shutdown get this long to finish


class BusService(Protocol):
    async def start(self) -> None:
        """Subscribe and serve; return once requests are being answered."""

    async def run_forever(self) -> None:
        """The service's periodic work (registry refresh, sweeps); runs until cancelled at stop."""


@asynccontextmanager
async def bus_connection(name: str, settings: ServiceSettings) -> AsyncIterator[tuple[Bus, WorkerRegistry]]:
    """The bus, connected as ``name``, and the namespace's worker registry (watched); the process is
    announced in the services bucket meanwhile (``shared.runtime.announce``). Leaving the
    block normally gives the requests in flight ``STOP_SERVING_TIMEOUT_S`` to finish; the bus is
    closed either way."""
    bus = await Bus.connect(settings.nats_url, name)
    announcer = None
    try:
        registry = await WorkerRegistry.open(bus, Subjects(settings.namespace).workers_bucket,
                                             ttl_s=settings.registry_ttl_s, watch=True)
        services = await open_services(bus, settings.namespace, settings.registry_ttl_s)
        announcer = asyncio.create_task(announce_forever(
            services, this_service(name, settings.num_restarts), settings.registry_ttl_s / 3))
        yield bus, registry
        await bus.stop_serving(timeout_s=STOP_SERVING_TIMEOUT_S)
    finally:
        if announcer is not None:
            announcer.cancel()
            await asyncio.gather(announcer, return_exceptions=True)
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
        await serve_until_stopped(name, make(bus, registry), stop, settings.namespace)


async def every(interval_s: float, work: Callable[[], Awaitable[object]], what: str) -> None:
    """Run ``work`` now and then every ``interval_s`` until cancelled. A failed round is logged and
    the next one tries again: NATS reconnecting or Redis restarting must not end the loop."""
    while True:
        try:
            await work()
        except Exception as exc:  # noqa: BLE001 — keep the last state until the next round
            log.warning("%s failed: %r", what, exc)
        await asyncio.sleep(interval_s)
