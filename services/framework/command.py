"""A service's ``tandem <name>`` sub-command: one ``--flag`` per field of its settings class, and
the runner that builds the settings and calls the service.

A command is registered with the function it runs, imported by the service's own registration
module; that function keeps its heavy imports (torch, nats) inside, so ``tandem --help`` stays
cheap. Flags given on the command line win over ``TANDEM_*`` variables, which win over defaults.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any, Literal, TypeVar, get_args, get_origin

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from services.framework.errors import CliError

S = TypeVar("S", bound=BaseSettings)

ServiceRun = Callable[[Any, asyncio.Event], Awaitable[None]]


def register_service(subparsers, name: str, help_text: str, settings_class, run: ServiceRun) -> None:
    """Add ``tandem <name>``, a service process: ``run(settings, stop_event)`` under
    ``services.framework.lifecycle.run_service`` (logging, signals, one asyncio loop)."""
    register_command(subparsers, name, help_text, settings_class, partial(_run_service, name, run))


def register_command(subparsers, name: str, help_text: str, settings_class,
                     main: Callable[[Any], int | None], epilog: str | None = None) -> None:
    """Add ``tandem <name>``: ``main(settings)`` returns the exit code (``epilog``: what its
    ``--help`` says after the flags, e.g. those codes)."""
    parser = subparsers.add_parser(name, help=help_text, description=help_text, epilog=epilog)
    add_settings_arguments(parser, settings_class)
    parser.set_defaults(func=partial(_run_command, main), settings_class=settings_class)


def _run_command(main: Callable[[Any], int | None], args: argparse.Namespace) -> int | None:
    return main(settings_from_args(args.settings_class, args))


def _run_service(name: str, run: ServiceRun, settings) -> int:
    from services.framework.lifecycle import run_service  # noqa: PLC0415 — nats, prometheus

    return run_service(name, settings.log_level, lambda stop: run(settings, stop), log_format=settings.log_format)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_settings_arguments(parser, cls: type[BaseSettings], exclude: Iterable[str] = ()) -> None:
    """One ``--flag`` per field (but ``exclude``), plus the spellings a field's ``cli_flags`` adds
    (``shared.engine_settings``); defaults stay None so that unset flags fall back to the env.
    ``parser``: a parser or one of its argument groups."""
    for name, info in cls.model_fields.items():
        if name in exclude:
            continue
        env = f"TANDEM_{name.upper()}"
        given = "required" if info.is_required() else f"default {info.get_default(call_default_factory=True)!r}"
        help_text = f"{info.description or name} (env {env}, {given})"
        if _env_only(info):
            help_text = f"{info.description or name} (env {env} only: refused as a flag, which ps shows)"
        kwargs: dict[str, Any] = {"dest": name, "default": None, "help": help_text}
        annotation = _without_none(info.annotation)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        aliases = list(extra.get("cli_flags", []))
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            for alias in [a for a in aliases if a.startswith("--no-")]:  # a second way to turn it off
                parser.add_argument(alias, dest=name, action="store_false", default=None,
                                    help=f"as --no-{_flag(name)[2:]}")
                aliases.remove(alias)
        elif get_origin(annotation) is Literal:
            kwargs["choices"] = list(get_args(annotation))
        parser.add_argument(_flag(name), *aliases, **kwargs)


def _without_none(annotation: Any) -> Any:
    """``X | None`` → ``X`` (an optional Literal still gets its choices); anything else as it is."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if len(args) == 1 and type(None) in get_args(annotation):
        return args[0]
    return annotation


ENV_ONLY = {"env_only": True}  # a field's json_schema_extra: a secret refused on the command line, which ps shows


def _env_only(info) -> bool:
    return isinstance(info.json_schema_extra, dict) and bool(info.json_schema_extra.get("env_only"))


def settings_from_args(cls: type[S], args: argparse.Namespace) -> S:
    """Build the settings from flags given on the command line plus the environment."""
    given = {name: getattr(args, name) for name in cls.model_fields
             if getattr(args, name, None) is not None}
    if secret := [name for name in given if _env_only(cls.model_fields[name])]:
        name = secret[0]
        raise CliError(f"{_flag(name)} on the command line is seen by every user of this machine (ps): put its "
                       f"value in TANDEM_{name.upper()}" + (f" or in a file named by {_flag(name)}-file" if
                                                            f"{name}_file" in cls.model_fields else ""))
    try:
        return cls(**given)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {_message(e['msg'])}"
                             for e in exc.errors())
        raise CliError(f"invalid settings: {problems}") from None


def _message(msg: str) -> str:
    return msg.removeprefix("Value error, ")
