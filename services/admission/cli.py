"""``tandem admission``: admit each request to a decode worker (KV overlap + load) or reject it."""

import asyncio

from services.admission.config import AdmissionSettings
from services.framework.command import register_service

HELP = "run the admission service (accept/reject; choose the decode worker)"


def register(subparsers) -> None:
    register_service(subparsers, "admission", HELP, AdmissionSettings, run)


async def run(settings: AdmissionSettings, stop: asyncio.Event) -> None:
    from services.admission.service import run as run_admission  # noqa: PLC0415 — nats only when it runs

    await run_admission(settings, stop)
