"""Files and batches (the OpenAI Batch API) as they are kept in NATS: a file's record (the
description of its object in the files Object Store), a batch's record (a KV entry, updated by
compare-and-set), one input line as a JetStream work item, and one line's result (a KV entry
written once). Bodies of OpenAI requests and responses travel as JSON text, never as open dicts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.protocol.base import WireModel

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                      "cancelling", "cancelled"]
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]


class FileRecord(WireModel):
    """An uploaded file as OpenAI's file object describes it (the bytes are the object itself)."""

    id: str
    bytes: int = Field(ge=0)
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    # who may see it: the owner id of the API key that uploaded it (a batch's result files: the
    # batch's owner); None: the anonymous owner (no keys configured, or stored before owners were)
    owner: str | None = None


class BatchLineError(WireModel):
    """One reason a batch failed validation; ``line`` is 1-based (None: the file as a whole)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None


class RequestCounts(WireModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchRecord(WireModel):
    """A batch's state. Timestamps are epoch seconds (int, as OpenAI's); ``claimed_at`` (float) is
    when a gateway last took the batch's next step (validation, finalization): another leaves it
    alone until the claim is stale, so one step runs once at a time across gateways."""

    id: str
    endpoint: BatchEndpoint
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus = "validating"
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    errors: list[BatchLineError] = Field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    request_counts: RequestCounts = RequestCounts()
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    claimed_at: float | None = None
    owner: str | None = None  # as FileRecord.owner; its result files get the same owner


class BatchLineRequest(WireModel):
    """One input line to run: the batch's work queue holds one per line (``line`` 1-based)."""

    batch_id: str
    line: int = Field(ge=1)
    custom_id: str
    url: BatchEndpoint
    body: str  # the request body, JSON text


class BatchLineResult(WireModel):
    """One line's outcome, written once under (batch id, custom_id). ``status_code`` and ``body``
    (JSON text) are the HTTP answer the same request got online; ``error_code``/``error_message``
    stand for a line that got no HTTP answer (e.g. the batch expired first)."""

    batch_id: str
    line: int = Field(ge=1)
    custom_id: str
    request_id: str = ""
    status_code: int | None = None
    body: str | None = None
    error_code: str | None = None
    error_message: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.status_code == 200
