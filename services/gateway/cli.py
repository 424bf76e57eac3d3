"""``tandem gateway``: the OpenAI-compatible HTTP API (``tandem status`` reads its cluster view)."""

import asyncio

from services.framework.command import register_service
from services.gateway.config import GatewaySettings

HELP = "run the HTTP gateway (OpenAI chat/completions, SSE, /metrics, /status)"


def register(subparsers) -> None:
    register_service(subparsers, "gateway", HELP, GatewaySettings, run)


async def run(settings: GatewaySettings, stop: asyncio.Event) -> None:
    from services.gateway.service import run as run_gateway  # noqa: PLC0415 — nats only when it runs

    await run_gateway(settings, stop)
