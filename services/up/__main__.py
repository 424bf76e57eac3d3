"""``tandem up``: nats-server, redis-server and every service as local processes."""

import argparse
import sys

from services.up.config import UpSettings
from shared.runtime.settings import add_settings_arguments, settings_from_args

HELP = "start the whole stack locally (embedded NATS + Redis, every service its own process)"


def register(subparsers) -> None:
    parser = subparsers.add_parser("up", help=HELP, description=HELP)
    add_settings_arguments(parser, UpSettings)
    parser.set_defaults(func=main, settings_class=UpSettings)


def main(args: argparse.Namespace) -> int:
    from services.up.service import run

    return run(settings_from_args(UpSettings, args))


if __name__ == "__main__":
    from shared.runtime.command import run_as_main

    sys.exit(run_as_main("up"))
