"""Logging setup shared by every command: one line per record on stderr, tagged by service; as
text (default) or JSON lines (``--log-format json`` / ``TANDEM_LOG_FORMAT=json``).

A JSON line about a request carries its ``request_id`` and, when traced, its ``trace_id``: the
request id lives in a context variable that the gateway's handler and every bus handler set for
the request they serve (``bind_request_id``), so each line logged while serving it, in any
module, is tagged without passing ids around.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

from shared.process_settings import process_settings
from shared.telemetry.redact import RedactSecrets

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("tandem_request_id", default=None)


def bind_request_id(request_id: str | None) -> None:
    """Tag the log lines of the current task (and the tasks it starts) with ``request_id``."""
    _request_id.set(request_id)


def current_request_id() -> str | None:
    return _request_id.get()


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, service, logger, message, request_id, trace_id,
    and the traceback as ``exc_info`` when there is one."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        from shared.telemetry.tracing import trace_id_hex

        line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                      + f".{int(record.msecs):03d}Z",
                "level": record.levelname, "service": self.service, "logger": record.name,
                "message": record.getMessage()}
        if (request_id := _request_id.get()) is not None:
            line["request_id"] = request_id
        if (trace_id := trace_id_hex()) is not None:
            line["trace_id"] = trace_id
        if record.exc_info:  # the redacting filter may have set exc_text already
            line["exc_info"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(service: str = "tandem", level: str | None = None, log_format: str | None = None) -> None:
    """Log to stderr at ``level`` in ``log_format`` (defaults: ``TANDEM_LOG_LEVEL``, ``TANDEM_LOG_FORMAT``).
    Every command starts here, so the library's other ``TANDEM_*`` variables are checked here too:
    a bad value raises ``InvalidSetting`` naming it before the command does anything."""
    settings = process_settings()
    level = (level or settings.log_level).upper()
    log_format = (log_format or settings.log_format).lower()
    if log_format not in ("text", "json"):
        raise ValueError(f"log format {log_format!r}: use text or json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if log_format == "json" else logging.Formatter(
        f"%(asctime)s %(levelname)s [{service}] %(name)s: %(message)s", datefmt="%H:%M:%S"))
    handler.addFilter(RedactSecrets())  # on the handler: it sees every logger's records
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
