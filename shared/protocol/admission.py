"""Admission's answer to a GenerateRequest."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.protocol.base import RequestId, WireModel, WorkerId

# "overloaded": every worker's queue is over its limit (HTTP 429); "unavailable": no ready decode
# worker serves the model (HTTP 503).
RejectReason = Literal["overloaded", "unavailable"]


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
