"""``tandem admission``: admit each request to a decode worker (KV overlap + load) or reject it."""

import argparse
import sys

from services.admission.config import AdmissionSettings
from shared.runtime.settings import add_settings_arguments, settings_from_args

HELP = "run the admission service (accept/reject; choose the decode worker)"


def register(subparsers) -> None:
    parser = subparsers.add_parser("admission", help=HELP, description=HELP)
    add_settings_arguments(parser, AdmissionSettings)
    parser.set_defaults(func=main, settings_class=AdmissionSettings)


def main(args: argparse.Namespace) -> int:
    from services.admission.service import run
    from shared.runtime.service import run_service

    settings = settings_from_args(AdmissionSettings, args)
    return run_service("admission", settings.log_level, lambda stop: run(settings, stop))


if __name__ == "__main__":
    from shared.cli.main import main as cli_main

    sys.exit(cli_main(["admission", *sys.argv[1:]]))
