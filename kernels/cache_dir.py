"""Tandem's cache root, where fetched models (``shared/model/registry.py``), built CPU kernels
(``cpu_build.py``), compiled decode steps and ``tandem up``'s state live. Here, below ``shared/``,
because the kernels are its lowest user."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache root: ``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem`` (read on every call, so tests
    can point it elsewhere)."""
    configured = os.environ.get("TANDEM_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "tandem"
