"""``tandem decode``: a decode worker (the engine) serving its NATS subjects."""

import argparse
import sys

from services.decode.config import DecodeSettings
from shared.runtime.settings import add_settings_arguments, settings_from_args

HELP = "run a decode worker (loads the model, warms up, registers, streams tokens)"


def register(subparsers) -> None:
    parser = subparsers.add_parser("decode", help=HELP, description=HELP)
    add_settings_arguments(parser, DecodeSettings)
    parser.set_defaults(func=main, settings_class=DecodeSettings)


def main(args: argparse.Namespace) -> int:
    from services.decode.service import run
    from shared.runtime.service import run_service

    settings = settings_from_args(DecodeSettings, args)
    return run_service("decode", settings.log_level, lambda stop: run(settings, stop))


if __name__ == "__main__":
    from shared.cli.main import main as cli_main

    sys.exit(cli_main(["decode", *sys.argv[1:]]))
