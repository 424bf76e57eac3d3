"""``tandem prefill``: a prefill worker pulling the global prefill queue, writing KV with NIXL."""

import asyncio
from collections.abc import Mapping
from functools import partial

from services.framework.command import register_service
from services.prefill.config import PrefillSettings
from services.worker.role_builder import RoleBuilder
from shared.protocol.workers import Role

HELP = ("run a prefill worker (pulls the JetStream prefill queue, computes prompt KV, writes it into decode workers' "
        "blocks over NIXL, then acks)")


def register(subparsers, builders: Mapping[Role, RoleBuilder]) -> None:
    """``builders``: every role the worker may flip to, this one included (``services.cli``)."""
    register_service(subparsers, "prefill", HELP, PrefillSettings, partial(run, builders))


async def run(builders: Mapping[Role, RoleBuilder], settings: PrefillSettings, stop: asyncio.Event) -> None:
    from services.worker.process import run_worker  # noqa: PLC0415 — torch, nats only when it runs

    await run_worker(settings, stop, builders)
