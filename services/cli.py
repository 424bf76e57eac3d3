"""`tandem`: the one registry of its sub-commands, each with its own ``--help``.

Every entry of ``COMMANDS`` is a ``register(subparsers)`` function, imported here (but
``register_workers``, which hands ``tandem decode`` and ``tandem prefill`` both worker roles), that
adds its parser and sets ``func`` (taking the parsed args, returning an exit code). Registration stays
cheap: heavy imports (torch, nats) happen inside the function a command runs. ``shared/`` never
imports ``services/``; the registry that names the services lives here, on their side.
"""

from __future__ import annotations

import argparse
import sys

from services.admission import cli as admission
from services.autoscaler import cli as autoscaler
from services.commands import control_cmds, model_cmds, plan_cmds, protocol_cmds, rank_cmd, status, worker_check
from services.framework.errors import CliError
from services.decode import cli as decode
from services.decode.role import DECODE
from services.gateway import cli as gateway
from services.join import cli as join
from services.kv_index import cli as kv_index
from services.prefill import cli as prefill
from services.prefill.role import PREFILL
from services.up import cli as up
from services.up import credentials
from shared import __version__
from shared.process_settings import InvalidSetting


def register_workers(subparsers) -> None:
    """``tandem decode`` and ``tandem prefill``: one worker process serves either role and flips
    between them, so each command gets both builders (``services.worker`` imports neither role)."""
    builders = {"decode": DECODE, "prefill": PREFILL}
    decode.register(subparsers, builders)
    prefill.register(subparsers, builders)


COMMANDS = [
    model_cmds.register,  # complete, chat, model fetch
    plan_cmds.register,  # plan, simulate
    up.register,
    join.register,
    credentials.register,  # credentials rotate, finish
    gateway.register,
    status.register,
    admission.register,
    register_workers,  # decode, prefill
    kv_index.register,
    autoscaler.register,
    control_cmds.register,
    protocol_cmds.register,
    worker_check.register,
    rank_cmd.register,  # a rank of a parallel worker on another host
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: disaggregated LLM serving.",
        epilog="Settings also come from TANDEM_* environment variables (see each command's --help).")
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in COMMANDS:
        register(subparsers)
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
        return exc.exit_code
    except InvalidSetting as exc:  # a TANDEM_* variable every command reads (shared/process_settings.py)
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
