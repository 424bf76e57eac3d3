"""Stored responses of ``/v1/responses`` (OpenAI's ``store``) as they are kept in NATS: one KV
entry per response, changed by compare-and-set while a background response runs. The response
object and the input items are OpenAI JSON and travel as JSON text, never as open dicts."""

from __future__ import annotations

from typing import Literal

from shared.protocol.base import WireModel

ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
FINAL_STATUSES = ("completed", "incomplete", "failed", "cancelled")


class StoredResponse(WireModel):
    """A response and the input that made it. ``input_items`` are this request's own items (each
    with its ``id``); the items of earlier turns stay with the responses that
    ``previous_response_id`` links to, so a conversation is stored once however long it gets."""

    id: str
    created_at: int
    status: ResponseStatus
    response: str                            # the response object (JSON), as GET returns it
    input_items: str                         # JSON list of this request's input items
    previous_response_id: str | None = None
    background: bool = False
    origin: str | None = None                # the gateway running it, while queued or in progress
    owner: str | None = None                 # as FileRecord.owner (shared.protocol.batch)

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES
