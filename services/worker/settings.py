"""Settings of every service that runs an engine (decode and prefill workers).

The engine fields are not written here: ``engine_settings()`` derives them from their one
definition, ``shared/engine_settings.py`` (with the workers' defaults for compile and speculative
decoding); this module adds the worker's own fields.
"""

from __future__ import annotations

import os
import re
import socket

from pydantic import Field, model_validator

from shared.engine_settings import engine_settings
from services.framework.settings import ServiceSettings


# the workers' draft length: on the CPU 2.36x at 1 stream, 1.02x / 0.98x at 8 / 32 on bench.serving
# (where more than --speculative-max-batch requests run, nobody speculates); on an H200 (CUDA graphs)
# bench.speculative gives 2.35x / 1.65x on edits and 1.02x / 0.97x on chat at batch 1 / 4
SPECULATIVE_TOKENS = 6


def default_worker_id(role: str) -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40]
    return f"{role}-{host}-{os.getpid()}"


# where a worker's default differs from the engine's: it compiles its decode step on a thread while it
# serves eagerly, and speculates
WORKER_DEFAULTS = {"speculative_tokens": SPECULATIVE_TOKENS, "compile": "background"}

# every engine field (shared/engine_settings.py) after the services' own
_WorkerEngineFields = engine_settings("_WorkerEngineFields", ServiceSettings, defaults=WORKER_DEFAULTS)


class EngineWorkerSettings(_WorkerEngineFields):
    """A worker's settings: the engine's (defined in ``shared/engine_settings.py``, a worker
    compiling in the background and speculating by default) and the worker's own below."""

    num_warmup_requests: int = Field(4, ge=0, description="warm-up requests before registering ready")
    warmup_prefill_rate: bool = Field(True, description="end warm-up by measuring the prefill rate on a "
                                      "512-token prompt, which admission predicts TTFT from until real prompts "
                                      "measure one (off: requests are admitted unpredicted until then)")
    load_interval_s: float = Field(1.0, gt=0, description="WorkerLoad publish period")
    drain_timeout_s: float = Field(120.0, ge=0, description="on SIGTERM, how long to finish in-flight work")
    events_max_age_s: float = Field(3600.0, gt=0, description="KV event stream retention (seconds)")
    events_max_msgs: int = Field(1_000_000, gt=0, description="KV event stream retention (messages)")
    host_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$", description="the joined host's id "
                                "(tandem join passes the one kept in its state directory), carried in the registry "
                                "entry so that two hosts under one host name are told apart")

    @model_validator(mode="after")
    def _batch_covers_a_block(self):
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"block_size ({self.block_size})")
        return self

    def engine_config(self):
        from shared.engine.config import engine_config  # noqa: PLC0415 — torch only when a worker runs

        return engine_config(self)
