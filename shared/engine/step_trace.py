"""One JSON line per engine step, for finding where requests wait: when the step started
(``time.monotonic()``, the clock every process on the host shares), how long it ran, and each row it
carried (request id, priority, first position, tokens, whether they are prompt tokens, draft tokens);
when a step stopped between two layers for a more urgent request, the ids of the rows it left
(``paused``: the line of the step that ends them lists their rows).

On with a worker's ``--step-trace FILE`` (``TANDEM_STEP_TRACE``); ``python -m loadtest.tools.step_trace
FILE`` sums a trace up (``bench.batch --step-trace`` does it per phase of its run). A line costs a few
microseconds of a step's tens of milliseconds; the file grows by about 100 bytes per row.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from shared.engine.scheduler import ScheduledRequest, SchedulerOutput


class StepTrace:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 — closed by close()
        self._lock = threading.Lock()

    def record(self, started: float, seconds: float, out: SchedulerOutput,
               paused: list[ScheduledRequest] | tuple = ()) -> None:
        """``paused``: entries whose layers ran in part in this step, which stopped for a more urgent
        request (their rows are listed, once, by the line of the step that ends them)."""
        rows = [{"id": s.request.request_id, "priority": s.request.priority, "start": s.start,
                 "tokens": s.num_new_tokens, "prompt": s.start < s.request.num_prompt_tokens, "draft": len(s.draft)}
                for s in out.scheduled]
        entry = {"t": round(started, 6), "s": round(seconds, 6), "rows": rows}
        if paused:
            entry["paused"] = [s.request.request_id for s in paused]
        line = json.dumps(entry, separators=(",", ":"))
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()
