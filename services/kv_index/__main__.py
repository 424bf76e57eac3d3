"""``tandem kv-index``: the prefix-hash → owners index (NATS KV events in, Redis, match queries)."""

import sys

from services.kv_index.config import KvIndexSettings
from shared.runtime.command import register_service, run_as_main


def register(subparsers) -> None:
    register_service(subparsers, "kv-index", "run the KV index service (KV events → Redis prefix index; answers match queries)",
                     KvIndexSettings, "services.kv_index.service:run")


if __name__ == "__main__":
    sys.exit(run_as_main("kv-index"))
