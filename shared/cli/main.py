"""`tandem` command line: one sub-command per module, each with its own ``--help``.

Every module listed in ``COMMAND_MODULES`` defines ``register(subparsers)``, which adds its parser
and sets ``func`` (taking the parsed args, returning an exit code). Registration must stay cheap:
heavy imports (torch, nats) happen inside ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from shared import __version__
from shared.cli.errors import CliError  # noqa: F401  (re-exported: commands raise it)

COMMAND_MODULES = [
    "shared.cli.model_cmds",  # complete, chat, model fetch
    "shared.cli.plan_cmds",
    "services.up.__main__",  # up
    "services.join.__main__",  # join
    "services.gateway.__main__",  # gateway, status
    "services.admission.__main__",
    "services.decode.__main__",
    "services.prefill.__main__",
    "services.kv_index.__main__",
    "services.autoscaler.__main__",
    "shared.cli.control_cmds",
    "shared.cli.protocol_cmds",  # protocol
    "shared.cli.worker_check",  # worker-check
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: disaggregated LLM serving.",
        epilog="Settings also come from TANDEM_* environment variables (see each command's --help).")
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
