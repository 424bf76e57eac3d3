"""Files and batches as the OpenAI API returns them (``openai.types.FileObject`` and ``Batch``),
and the ids Tandem gives them."""

from __future__ import annotations

import secrets

from shared.protocol.batch import BatchRecord, FileRecord


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def result_file_ids(batch_id: str) -> tuple[str, str]:
    """The output and error files' ids: fixed by the batch, so a finalization that runs twice (its
    gateway died after writing them) writes the same two files again, never two more."""
    suffix = batch_id.removeprefix("batch_")
    return f"file-{suffix}-output", f"file-{suffix}-errors"


def file_object(record: FileRecord) -> dict:
    """The owner is Tandem's (who may see the file), not a field of OpenAI's object."""
    return {"object": "file", "expires_at": None, "status_details": None,
            **record.model_dump(mode="json", exclude={"owner"})}


def batch_object(record: BatchRecord) -> dict:
    body = record.model_dump(mode="json", exclude={"claimed_at", "errors", "owner"})
    errors = None
    if record.errors:
        errors = {"object": "list", "data": [e.model_dump(mode="json") for e in record.errors]}
    return {"object": "batch", **body, "errors": errors, "model": None, "usage": None}
