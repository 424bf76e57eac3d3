"""Tandem's cache root, where fetched models (``shared/model/registry.py``), built CPU kernels
(``cpu_build.py``), compiled decode steps and ``tandem up``'s state live. Here, below ``shared/``,
because the kernels are its lowest user."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class CacheSettings(BaseSettings):
    """``TANDEM_CACHE_DIR``: the one setting the kernels read (``shared.process_settings`` holds
    the library's others; this layer imports nothing of ``shared``)."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid", env_ignore_empty=True)

    cache_dir: Path | None = Field(None, description="cache root: fetched models, built CPU kernels, "
                                   "compiled decode steps and tandem up's state (default: ~/.cache/tandem)")


def cache_dir() -> Path:
    """The cache root: ``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem`` (read on every call, so tests
    can point it elsewhere)."""
    configured = CacheSettings().cache_dir
    return configured.expanduser() if configured else Path.home() / ".cache" / "tandem"
