"""``tandem kv-index``: the prefix-hash → owners index (NATS KV events in, Redis, match queries)."""

import asyncio

from services.framework.command import register_service
from services.kv_index.config import KvIndexSettings

HELP = "run the KV index service (KV events → Redis prefix index; answers match queries)"


def register(subparsers) -> None:
    register_service(subparsers, "kv-index", HELP, KvIndexSettings, run)


async def run(settings: KvIndexSettings, stop: asyncio.Event) -> None:
    from services.kv_index.service import run as run_kv_index  # noqa: PLC0415 — nats only when it runs

    await run_kv_index(settings, stop)
