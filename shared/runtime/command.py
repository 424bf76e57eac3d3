"""The CLI wiring every service shares: a parser built from its settings class, and a runner."""

from __future__ import annotations

import argparse
import importlib
import sys
from functools import partial

from shared.runtime.settings import add_settings_arguments, settings_from_args


def register_service(subparsers, name: str, help_text: str, settings_class, run_target: str) -> None:
    """Add ``tandem <name>``: one flag per setting; ``run_target`` ("module:function") is imported
    only when the command runs and is called as ``function(settings, stop_event)``."""
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    add_settings_arguments(parser, settings_class)
    parser.set_defaults(func=partial(_run, name, run_target), settings_class=settings_class)


def _run(name: str, run_target: str, args: argparse.Namespace) -> int:
    from shared.runtime.service import run_service

    module, function = run_target.split(":")
    run = getattr(importlib.import_module(module), function)
    settings = settings_from_args(args.settings_class, args)
    return run_service(name, settings.log_level, lambda stop: run(settings, stop), log_format=settings.log_format)


def run_as_main(name: str) -> int:
    """``python -m services.<pkg>`` behaves as ``tandem <name>``."""
    from shared.cli.main import main as cli_main

    return cli_main([name, *sys.argv[1:]])
