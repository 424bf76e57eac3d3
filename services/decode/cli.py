"""``tandem decode``: a decode worker (the engine) serving its NATS subjects."""

import asyncio
from collections.abc import Mapping
from functools import partial

from services.decode.config import DecodeSettings
from services.framework.command import register_service
from services.worker.role_builder import RoleBuilder
from shared.protocol.workers import Role

HELP = "run a decode worker (loads the model, warms up, registers, streams tokens)"


def register(subparsers, builders: Mapping[Role, RoleBuilder]) -> None:
    """``builders``: every role the worker may flip to, this one included (``services.cli``)."""
    register_service(subparsers, "decode", HELP, DecodeSettings, partial(run, builders))


async def run(builders: Mapping[Role, RoleBuilder], settings: DecodeSettings, stop: asyncio.Event) -> None:
    from services.worker.process import run_worker  # noqa: PLC0415 — torch, nats only when it runs

    await run_worker(settings, stop, builders)
