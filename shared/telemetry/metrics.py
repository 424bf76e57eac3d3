"""Prometheus metrics through ``prometheus-client``: one registry per service process, served on
``/metrics`` from its own port; and the recent-window mean the load reports use.

Each service builds its metric objects on its own ``CollectorRegistry`` (not the library's global
one), so two services in one test process, or one test after another, never share a series.
Recording is thread-safe (the library locks), which the engine thread relies on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager

import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

# Without this every counter and histogram also exports a ``_created`` timestamp series: noise on
# every scrape and in every dashboard query, and nothing here reads it.
prometheus_client.disable_created_metrics()

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# engine steps and single KV writes are short; the latency buckets would put them all in one
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def service_registry(service: str, instance: str, num_restarts: int) -> CollectorRegistry:
    """A fresh registry with what every service exports: the process's CPU, memory and file
    descriptors (``process_*``), which service this is, and how often its supervisor restarted it."""
    registry = CollectorRegistry()
    prometheus_client.ProcessCollector(registry=registry)
    info = Gauge("tandem_service_info", "which Tandem service this process is (always 1)",
                 ["service", "instance"], registry=registry)
    info.labels(service=service, instance=instance).set(1)
    restarts = Counter("tandem_service_restarts", "times a supervisor restarted this service after a crash",
                       registry=registry)
    restarts.inc(num_restarts)  # handed over by the supervisor: the count survives the restart
    return registry


class CallbackCollector(Collector):
    """Families computed at scrape time by ``collect_fn`` (state owned elsewhere, e.g. the engine's
    counters: copying them into gauges on every change would cost the token path)."""

    def __init__(self, collect_fn: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect_fn

    def collect(self) -> Iterable[Metric]:
        return list(self._collect())


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The text exposition of ``registry`` and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


@asynccontextmanager
async def metrics_site(registry: CollectorRegistry, host: str, port: int,
                       key: str | None = None) -> AsyncIterator[str]:
    """Serve ``registry`` on ``http://host:port/metrics`` (port 0: any free one) for the block;
    yields the bound URL. With ``key``, a scrape must send ``Authorization: Bearer <key>`` (as
    Prometheus does with ``authorization: {credentials_file: ...}``); any other gets a 401."""
    import hmac  # noqa: PLC0415

    from aiohttp import web  # noqa: PLC0415 — only services that serve import the web stack

    expected = f"Bearer {key}".encode() if key else None

    async def handler(request: web.Request) -> web.Response:
        if expected is not None and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode(), expected):
            return web.Response(status=401, text="this /metrics needs the operator key as a Bearer token\n",
                                headers={"WWW-Authenticate": 'Bearer realm="tandem metrics"'})
        body, content_type = exposition(registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = runner.addresses[0][1]
        yield f"http://{_reachable_host(host)}:{bound_port}/metrics"
    finally:
        await runner.cleanup()


def sample_total(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples called ``name`` (e.g. ``x_total``, ``y_seconds_count``) whose labels
    include ``labels``, in a text exposition; None when there is none (parsed with the library's
    own parser: scrapers and tests read what Prometheus would)."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    values = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
              if sample.name == name and labels.items() <= sample.labels.items()]
    return sum(values) if values else None


def _reachable_host(host: str) -> str:
    """What another machine puts in the URL when we listen on every interface."""
    if host in ("0.0.0.0", "::", ""):
        import socket  # noqa: PLC0415

        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


class RecentMean:
    """Mean of the observations of the last ``window_s`` seconds (None when there are none)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque()

    def observe(self, value: float, now: float | None = None) -> None:
        self._items.append((time.monotonic() if now is None else now, value))

    def mean(self, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        while self._items and self._items[0][0] < now - self.window_s:
            self._items.popleft()
        return sum(v for _, v in self._items) / len(self._items) if self._items else None
