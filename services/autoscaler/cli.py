"""``tandem autoscaler``: the cluster view that ``/status`` shows, and (``--autoscale``) role flips."""

import asyncio

from services.autoscaler.config import AutoscalerSettings
from services.framework.command import register_service

HELP = ("run the autoscaler (the cluster view; with --autoscale, flips workers between decode and prefill as the load "
        "shifts)")


def register(subparsers) -> None:
    register_service(subparsers, "autoscaler", HELP, AutoscalerSettings, run)


async def run(settings: AutoscalerSettings, stop: asyncio.Event) -> None:
    from services.autoscaler.service import run as run_autoscaler  # noqa: PLC0415 — nats only when it runs

    await run_autoscaler(settings, stop)
