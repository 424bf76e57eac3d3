"""``tandem kv-index``: the prefix-hash → owners index (NATS KV events in, Redis, match queries)."""

import argparse
import sys

from services.kv_index.config import KvIndexSettings
from shared.runtime.settings import add_settings_arguments, settings_from_args

HELP = "run the KV index service (KV events → Redis prefix index; answers match queries)"


def register(subparsers) -> None:
    parser = subparsers.add_parser("kv-index", help=HELP, description=HELP)
    add_settings_arguments(parser, KvIndexSettings)
    parser.set_defaults(func=main, settings_class=KvIndexSettings)


def main(args: argparse.Namespace) -> int:
    from services.kv_index.service import run
    from shared.runtime.service import run_service

    settings = settings_from_args(KvIndexSettings, args)
    return run_service("kv-index", settings.log_level, lambda stop: run(settings, stop))


if __name__ == "__main__":
    from shared.cli.main import main as cli_main

    sys.exit(cli_main(["kv-index", *sys.argv[1:]]))
