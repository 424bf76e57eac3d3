"""Workers: registry entries, load reports, control, and the cluster view built from them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.protocol.base import WireModel, WorkerId
from shared.protocol.prefill import PrefillQueueStatus

Role = Literal["decode", "prefill"]
WorkerState = Literal["starting", "ready", "draining"]


class WorkerInfo(WireModel):
    """A worker's entry in the ``<ns>-workers`` KV bucket, refreshed by its heartbeat."""

    worker_id: WorkerId
    role: Role
    state: WorkerState = "ready"
    model: str
    block_size: int = Field(ge=1)
    max_model_len: int = Field(ge=1)
    num_blocks_total: int = Field(0, ge=0)
    max_num_seqs: int = Field(1, ge=1)
    generate_subject: str
    cancel_subject: str = ""  # empty for prefill workers (their work comes from the queue)
    control_subject: str | None = None
    kv_namespace_hex: str = ""
    host: str = ""
    pid: int = 0
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    num_restarts: int = Field(0, ge=0)  # times its supervisor restarted it after a crash


class WorkerLoad(WireModel):
    """Published about once a second on ``<ns>.v1.load.<role>.<worker>``."""

    worker_id: WorkerId
    role: Role
    seq: int = Field(ge=0)
    timestamp: float
    num_running: int = Field(0, ge=0)
    num_waiting: int = Field(0, ge=0)
    num_blocks_used: int = Field(0, ge=0)
    num_blocks_total: int = Field(0, ge=0)
    num_cached_blocks: int = Field(0, ge=0)
    num_held: int = Field(0, ge=0)  # finished keep_kv requests whose blocks a transfer may still use
    max_num_seqs: int = Field(1, ge=1)
    ttft_recent_s: float | None = None
    itl_recent_s: float | None = None
    num_requests_total: int = Field(0, ge=0)
    num_requests_aborted: int = Field(0, ge=0)
    num_prompt_tokens_total: int = Field(0, ge=0)
    num_generated_tokens_total: int = Field(0, ge=0)
    # disaggregated prefill (decode: requests whose prompt was prefilled remotely / locally, remote
    # attempts that fell back to a local prefill; prefill: requests written / dropped)
    num_remote_prefills: int = Field(0, ge=0)
    num_local_prefills: int = Field(0, ge=0)
    num_prefill_fallbacks: int = Field(0, ge=0)
    num_prefills_dropped: int = Field(0, ge=0)
    kv_bytes_sent: int = Field(0, ge=0)
    kv_bytes_received: int = Field(0, ge=0)
    # for admission's TTFT prediction: by request priority (lower runs first), the prompt tokens
    # still to prefill and the waiting requests; and the recent prefill rate (None: not measured yet)
    queued_prefill_tokens: dict[int, int] = Field(default_factory=dict)
    num_waiting_by_priority: dict[int, int] = Field(default_factory=dict)
    prefill_tokens_per_s: float | None = Field(None, ge=0)

    def prefill_tokens_ahead(self, priority: int) -> int:
        """Tokens a new request of ``priority`` waits behind: its own priority and higher ones."""
        return sum(n for p, n in self.queued_prefill_tokens.items() if p <= priority)


class ControlRequest(WireModel):
    """``drain``/``stop``: finish in-flight work and leave. ``configure``: change the decode
    worker's conditional-disaggregation thresholds (fields left None keep their value).
    ``status``: change nothing, report."""

    action: Literal["drain", "stop", "configure", "status"]
    max_local_prefill_tokens: int | None = Field(None, ge=0)
    max_prefill_queue: int | None = Field(None, ge=0)


class ControlResult(WireModel):
    worker_id: WorkerId
    state: WorkerState
    num_in_flight: int = Field(0, ge=0)
    max_local_prefill_tokens: int | None = None
    max_prefill_queue: int | None = None


class ClusterStatusRequest(WireModel):
    pass


class WorkerStatus(WireModel):
    info: WorkerInfo
    load: WorkerLoad | None = None
    load_age_s: float | None = None


class ClusterStatusResult(WireModel):
    timestamp: float
    workers: list[WorkerStatus] = Field(default_factory=list)
    prefill_queue: PrefillQueueStatus | None = None  # None: no prefill queue exists (yet)
