"""``tandem autoscaler``: the cluster view (registry + load) that ``/status`` shows."""

import argparse
import sys

from services.autoscaler.config import AutoscalerSettings
from shared.runtime.settings import add_settings_arguments, settings_from_args

HELP = "run the autoscaler (first version: aggregates worker load into the cluster view)"


def register(subparsers) -> None:
    parser = subparsers.add_parser("autoscaler", help=HELP, description=HELP)
    add_settings_arguments(parser, AutoscalerSettings)
    parser.set_defaults(func=main, settings_class=AutoscalerSettings)


def main(args: argparse.Namespace) -> int:
    from services.autoscaler.service import run
    from shared.runtime.service import run_service

    settings = settings_from_args(AutoscalerSettings, args)
    return run_service("autoscaler", settings.log_level, lambda stop: run(settings, stop))


if __name__ == "__main__":
    from shared.cli.main import main as cli_main

    sys.exit(cli_main(["autoscaler", *sys.argv[1:]]))
