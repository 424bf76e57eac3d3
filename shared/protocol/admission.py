"""Admission's answer to a GenerateRequest."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.protocol.base import RequestId, WireModel, WorkerId
from shared.protocol.prefill import KvSource

# HTTP 429: "overloaded" (every worker's queue is at its limit), "slo" (predicted TTFT over the
# tier's SLO), "shedding" (a higher tier is missing its SLO), "tier_queue_full", "prompt_too_long",
# "deadline" (predicted to finish after the request's own deadline).
# HTTP 503: "unavailable" (no ready decode worker serves the model).
RejectReason = Literal["overloaded", "unavailable", "slo", "shedding", "tier_queue_full", "prompt_too_long",
                       "deadline"]


class AdmissionDecision(WireModel):
    request_id: RequestId
    is_admitted: bool
    worker_id: WorkerId | None = None
    generate_subject: str | None = None
    cancel_subject: str | None = None
    num_overlap_blocks: int = Field(0, ge=0)
    reject_reason: RejectReason | None = None
    message: str = ""
    retry_after_s: float = Field(0.0, ge=0.0)
    predicted_ttft_s: float | None = Field(None, ge=0.0)  # None: no prediction (no measured rate yet)
    kv_source: KvSource | None = None  # a worker holding more of the prefix than the chosen one
