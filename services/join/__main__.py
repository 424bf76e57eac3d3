"""``tandem join``: this host's workers, registered with a control plane that runs elsewhere."""

import argparse
import sys

from services.join.config import JoinSettings
from shared.runtime.settings import add_settings_arguments, settings_from_args

HELP = ("start decode/prefill workers on this host for a control plane elsewhere (tandem up on another "
        "host), with the credentials from its connect.env")


def register(subparsers) -> None:
    parser = subparsers.add_parser("join", help=HELP, description=HELP)
    add_settings_arguments(parser, JoinSettings)
    parser.set_defaults(func=main, settings_class=JoinSettings)


def main(args: argparse.Namespace) -> int:
    from services.join.service import run

    return run(settings_from_args(JoinSettings, args))


if __name__ == "__main__":
    from shared.runtime.command import run_as_main

    sys.exit(run_as_main("join"))
