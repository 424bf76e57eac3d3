"""Logging setup shared by every command: one line per record on stderr, tagged by service."""

from __future__ import annotations

import logging
import os
import sys

from shared.telemetry.redact import RedactSecrets


def configure_logging(service: str = "tandem", level: str | None = None) -> None:
    level = (level or os.environ.get("TANDEM_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s [{service}] %(name)s: %(message)s", datefmt="%H:%M:%S"))
    handler.addFilter(RedactSecrets())  # on the handler: it sees every logger's records
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
