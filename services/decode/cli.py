"""``tandem decode``: a decode worker (the engine) serving its NATS subjects."""

import asyncio

from services.decode.config import DecodeSettings
from services.framework.command import register_service

HELP = "run a decode worker (loads the model, warms up, registers, streams tokens)"


def register(subparsers) -> None:
    register_service(subparsers, "decode", HELP, DecodeSettings, run)


async def run(settings: DecodeSettings, stop: asyncio.Event) -> None:
    from services.worker.process import run_worker  # noqa: PLC0415 — torch, nats only when it runs

    await run_worker(settings, stop)
