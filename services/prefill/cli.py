"""``tandem prefill``: a prefill worker pulling the global prefill queue, writing KV with NIXL."""

import asyncio

from services.framework.command import register_service
from services.prefill.config import PrefillSettings

HELP = ("run a prefill worker (pulls the JetStream prefill queue, computes prompt KV, writes it into decode workers' "
        "blocks over NIXL, then acks)")


def register(subparsers) -> None:
    register_service(subparsers, "prefill", HELP, PrefillSettings, run)


async def run(settings: PrefillSettings, stop: asyncio.Event) -> None:
    from services.worker.process import run_worker  # noqa: PLC0415 — torch, nats only when it runs

    await run_worker(settings, stop)
