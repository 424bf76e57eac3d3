"""Every engine setting has one definition (``shared/engine_settings.py``): each command that runs an
engine reaches every field from its ``TANDEM_`` variable and from its flag, with the same default,
and the engine config gets the value. The commands are found in the CLI's own registry and the
fields in the definition, so a field or command added later is checked without editing this file."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Annotated, Literal, get_args, get_origin

import pytest

from services.cli import build_parser
from services.framework.command import settings_from_args
from services.worker.settings import WORKER_DEFAULTS
from shared.engine_settings import ENGINE_FIELDS, EngineOptions

ARGS = {"complete": ["hi"], "join": ["--connect", "connect.env"]}  # what a command needs to parse
REQUIRED = {"join": {"connect": "connect.env"}}  # its settings class's required fields among those
# the commands that run an engine in their process: each has every engine field
IN_PROCESS = ("decode", "prefill", "complete", "chat")
# fields a command leaves out of its flags, with the reason: ``tandem complete`` and ``chat`` have a
# per-request ``--seed`` (sampling); their engine's generator is seeded 0
LEFT_OUT = {"complete": {"seed"}, "chat": {"seed"}}
# a field named as an engine field that is another setting: the gateway's ``model`` is the alias it
# serves, whose tokenizer it loads
OTHER_MEANINGS = {("gateway", "model")}
DEFINITION = EngineOptions.__pydantic_fields__


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(subparsers.choices)


def _settings_class(command: str):
    return _commands()[command].get_default("settings_class")


def _is_derived(derived, name: str) -> bool:
    """The definition's type, validation and help (a command may put a note first, and leave the
    value unset: None)."""
    defined = DEFINITION[name]
    return (derived.annotation in (defined.annotation, defined.annotation | None)
            and derived.metadata == defined.metadata and derived.description.endswith(defined.description))


def engine_fields_of(command: str) -> list[str]:
    fields = getattr(_settings_class(command), "model_fields", {})
    return sorted(n for n in set(ENGINE_FIELDS) & set(fields) if (command, n) not in OTHER_MEANINGS)


def engine_commands() -> list[str]:
    """Every command with a setting of the engine's."""
    return sorted(name for name in _commands() if engine_fields_of(name))


def _base_type(annotation):
    args = [a for a in get_args(annotation) if a is not type(None)]
    if type(None) in get_args(annotation) and len(args) == 1:
        annotation = args[0]
    return get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation


def sample(name: str, default):
    """A valid value of the field other than ``default``: what a user would set."""
    kind = _base_type(DEFINITION[name].annotation)
    if get_origin(kind) is Literal:
        return next(c for c in reversed(get_args(kind)) if c not in (default, "auto", "none"))
    if kind is bool:
        return not default
    if kind is int:
        return 2 * default if default else 32  # a power of two, above every lower bound
    if kind is float:
        return default / 2
    return "x"


def _env_text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.fixture(autouse=True)
def _no_engine_env(monkeypatch):
    for name in ENGINE_FIELDS:
        monkeypatch.delenv(f"TANDEM_{name.upper()}", raising=False)  # tests/conftest.py pins TANDEM_COMPILE


def test_the_engine_commands_are_found():
    assert set(IN_PROCESS) | {"up", "join"} <= set(engine_commands())


@pytest.mark.parametrize("command", IN_PROCESS)
def test_a_command_that_runs_an_engine_has_every_engine_field(command):
    missing = set(ENGINE_FIELDS) - LEFT_OUT.get(command, set()) - set(engine_fields_of(command))
    assert not missing, f"tandem {command} lacks {sorted(missing)}"


@pytest.mark.parametrize("command", engine_commands())
def test_no_command_writes_an_engine_field_again(command):
    cls = _settings_class(command)
    help_text = " ".join(_commands()[command].format_help().split())
    for name in engine_fields_of(command):
        assert _is_derived(cls.model_fields[name], name), f"tandem {command}: {name} is not derived from EngineOptions"
        assert f"--{name.replace('_', '-')}" in help_text and f"env TANDEM_{name.upper()}" in help_text, name


@pytest.mark.parametrize("command", engine_commands())
def test_env_and_flag_give_one_value_and_one_default(command, monkeypatch):
    from shared.engine.config import engine_config

    cls, extra = _settings_class(command), ARGS.get(command, [])
    unset = settings_from_args(cls, build_parser().parse_args([command, *extra]))  # no flag, no variable
    for name in engine_fields_of(command):
        default = getattr(unset, name)
        assert default == getattr(cls(**REQUIRED.get(command, {})), name), name  # as the env alone gives it
        if command in IN_PROCESS:  # one default, but where a worker's differs on purpose
            workers = command in ("decode", "prefill") and name in WORKER_DEFAULTS
            assert default == (WORKER_DEFAULTS[name] if workers else getattr(EngineOptions(), name)), (command, name)
        value = sample(name, default)
        flag = f"--{name.replace('_', '-')}"
        flag_args = [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
        from_flag = settings_from_args(cls, build_parser().parse_args([command, *flag_args, *extra]))
        monkeypatch.setenv(f"TANDEM_{name.upper()}", _env_text(value))
        from_env = settings_from_args(cls, build_parser().parse_args([command, *extra]))
        monkeypatch.delenv(f"TANDEM_{name.upper()}")
        assert getattr(from_flag, name) == getattr(from_env, name) == value, (command, name)
        if command in IN_PROCESS:
            assert getattr(engine_config(from_flag), name) == value, (command, name)


def test_the_engine_config_is_the_definition():
    from shared.engine import EngineConfig

    assert issubclass(EngineConfig, EngineOptions)
    assert tuple(f.name for f in dataclasses.fields(EngineConfig)) == ENGINE_FIELDS
    assert set(WORKER_DEFAULTS) <= set(ENGINE_FIELDS)


def test_sizes_parse_from_text_and_old_flag_spellings_still_work():
    from services.commands.model_cmds import engine_config_from_args

    config = engine_config_from_args(build_parser().parse_args(
        ["complete", "--tp", "2", "--pp", "2", "--no-prefix-caching", "--kv-cache-memory", "512MiB", "hi"]))
    assert (config.tensor_parallel_size, config.pipeline_parallel_size, config.enable_prefix_caching) == (2, 2, False)
    assert config.kv_cache_memory == 512 << 20 and config.kv_disk_size == 10 << 30 and config.seed == 0
    assert engine_config_from_args(build_parser().parse_args(["complete", "hi"])).enable_prefix_caching is True


def test_model_fetch_reads_the_workers_variables(monkeypatch):
    from services.commands.model_cmds import FetchSettings

    monkeypatch.setenv("TANDEM_MODEL", "m.gguf")
    monkeypatch.setenv("TANDEM_BLOCK_SIZE", "32")
    args = build_parser().parse_args(["model", "fetch", "--num-threads", "2"])
    settings = settings_from_args(FetchSettings, args)
    assert (settings.model, settings.block_size, settings.num_threads) == ("m.gguf", 32, 2)
    args = build_parser().parse_args(["model", "fetch", "other", "--block-size", "64"])
    assert (settings_from_args(FetchSettings, args).model, settings_from_args(FetchSettings, args).block_size) == \
        ("other", 64)
