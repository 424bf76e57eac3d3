"""The library's process-wide settings: the ``TANDEM_*`` variables that code below the services
reads (logging, the NATS connection's defaults, the background compile), defined once with their
type, default and validation.

``process_settings()`` reads them from the environment on each call (cheap, and a variable set
later, such as a test's, is seen). A bad value raises ``InvalidSetting`` naming the variable;
``configure_logging`` reads them when a command starts, so a typo stops the process at once rather
than a thread long after. The services' settings classes (``services.framework.settings``) have
fields of the same names, given as flags; those win where a service passes them down.
``TANDEM_CACHE_DIR`` is ``kernels.cache_dir``'s (the kernels import nothing of ``shared``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "TANDEM_"
S = TypeVar("S", bound=BaseSettings)


class InvalidSetting(ValueError):
    """A ``TANDEM_*`` variable whose value does not parse; the message names the variable."""


def _stripped(value: Any) -> Any:
    return value.strip() if isinstance(value, str) else value


def _log_level(value: str) -> str:
    level = value.strip().upper()
    if level not in logging.getLevelNamesMapping():
        raise ValueError(f"unknown level {value!r} (DEBUG, INFO, WARNING, ERROR or CRITICAL)")
    return level


def _nice(value: int) -> int:
    return min(max(value, 0), 19)  # the range Linux has; outside it, the nearest end


class ProcessSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", env_ignore_empty=True)

    log_level: Annotated[str, AfterValidator(_log_level)] = Field(
        "INFO", description="logging level of the process (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    log_format: Annotated[Literal["text", "json"], BeforeValidator(lambda v: _stripped(v).lower())] = Field(
        "text", description="log lines as text, or as JSON lines carrying request_id and trace_id")
    nats_ca: str | None = Field(None, description="CA certificate file (PEM) for a NATS connection made "
                                "without one: connect over TLS and accept only a server certificate it signed")
    nats_replicas: int | None = Field(None, ge=1, le=5, description="copies JetStream keeps of each stream "
                                      "and bucket, where the caller names none (default: 1 on one server, up "
                                      "to 3 on a cluster, from the members the server names)")
    compile_cache_dir: Path | None = Field(None, description="where compiled decode steps are kept "
                                           "(default: TANDEM_CACHE_DIR/compile)")
    compile_nice: Annotated[int, AfterValidator(_nice)] = Field(
        19, description="nice value (0-19) of the background decode-step compile: 19, the lowest CPU "
        "priority, leaves serving the CPU first; 0 runs it beside serving as an equal")
    compile_process: Annotated[bool, BeforeValidator(_stripped)] = Field(
        True, description="compile a worker's background decode step in a child process (1, true, yes, "
        "on) or on the worker's own compile thread (0, false, no, off)")


def process_settings() -> ProcessSettings:
    """The settings as the environment gives them now; ``InvalidSetting`` for a bad value."""
    return load_settings(ProcessSettings)


def load_settings(cls: type[S]) -> S:
    """``cls()`` read from the environment, its validation errors as one line per variable."""
    try:
        return cls()
    except ValidationError as exc:
        raise InvalidSetting(invalid_variables(cls, exc)) from None


def invalid_variables(cls: type[BaseSettings], exc: ValidationError) -> str:
    """``TANDEM_X='value': what is wrong`` for each failed field of ``cls``, joined by '; '."""
    prefix = cls.model_config.get("env_prefix", "")
    problems = []
    for error in exc.errors():
        loc = error.get("loc") or ("settings",)
        name = f"{prefix}{str(loc[0]).upper()}"
        problems.append(f"{name}={error.get('input')!r}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(problems)
