"""The live dashboard at ``/dashboard``: static files (hand-written HTML, CSS and JS drawing on
canvas; nothing fetched from elsewhere, so it works offline) and the JSON they poll every second,
``/dashboard/data``: the gateway's cluster status (as ``/status``) and its recent latency and
throughput history."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Protocol

from aiohttp import web

from services.gateway.metrics import GatewayMetrics
from shared.protocol.status import StatusPage

STATIC_DIR = Path(__file__).parent / "static"
HISTORY_STEP_S = 5


class StatusSource(Protocol):
    metrics: GatewayMetrics

    async def cluster_status(self) -> StatusPage:
        """What ``/status`` answers."""


def add_dashboard_routes(app: web.Application, source: StatusSource) -> None:
    async def page(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "dashboard.html")

    async def data(request: web.Request) -> web.Response:
        return web.json_response(await dashboard_data(source, time.time()))

    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/data", data)
    app.router.add_static("/dashboard/static", STATIC_DIR)


async def dashboard_data(source: StatusSource, now: float) -> dict:
    series = source.metrics.series
    return {"now": now, "status": (await source.cluster_status()).model_dump(mode="json"), "step_s": HISTORY_STEP_S,
            "series": [dataclasses.asdict(p) for p in series.points(now, HISTORY_STEP_S)],
            "rejected_total": dict(series.rejected_total)}
