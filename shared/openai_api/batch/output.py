"""The output and error files of a finished batch, from its lines' results: one JSON line per
request, ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``, in
input order. A 200 goes to the output file, anything else to the error file; a line that never ran
before the window ended gets ``response: null`` and ``error: {"code": "batch_expired"}``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from shared.protocol.batch import BatchLineResult, RequestCounts

EXPIRED_MESSAGE = "This line was not run before the batch's completion window ended."


@dataclass(frozen=True)
class BatchFiles:
    output: bytes    # JSONL; empty: no line succeeded
    errors: bytes    # JSONL; empty: no line failed
    counts: RequestCounts


def line_id(batch_id: str, custom_id: str) -> str:
    return "batch_req_" + hashlib.sha256(f"{batch_id}\0{custom_id}".encode()).hexdigest()[:24]


def output_line(result: BatchLineResult) -> dict:
    response = None
    if result.status_code is not None:
        response = {"status_code": result.status_code, "request_id": result.request_id,
                    "body": json.loads(result.body) if result.body else None}
    error = None if result.error_code is None else {"code": result.error_code, "message": result.error_message}
    return {"id": line_id(result.batch_id, result.custom_id), "custom_id": result.custom_id,
            "response": response, "error": error}


def assemble(batch_id: str, results: list[BatchLineResult], total: int, *,
             expired: list[tuple[int, str]] = ()) -> BatchFiles:
    """The files from ``results`` (at most one per custom_id; any order) and, for an expired
    batch, the (line, custom_id) of each line left without a result."""
    missing = [BatchLineResult(batch_id=batch_id, line=line, custom_id=custom_id, error_code="batch_expired",
                               error_message=EXPIRED_MESSAGE) for line, custom_id in expired]
    ordered = sorted([*results, *missing], key=lambda r: r.line)
    ok = [r for r in ordered if r.is_ok]
    failed = [r for r in ordered if not r.is_ok]
    return BatchFiles(output=_jsonl(ok), errors=_jsonl(failed),
                      counts=RequestCounts(total=total, completed=len(ok), failed=len(failed)))


def _jsonl(results: list[BatchLineResult]) -> bytes:
    return b"".join(json.dumps(output_line(r)).encode() + b"\n" for r in results)
