"""The items of a stored response as OpenAI lists them (``/v1/responses/{id}/input_items``), and
the record a finished or background response is stored as. Pure: no bus."""

from __future__ import annotations

import json
import uuid

from shared.openai_api.errors import ApiError
from shared.openai_api.responses import page
from shared.openai_api.responses_api import FunctionCallItem, FunctionCallOutputItem, InputMessage, ResponsesRequest
from shared.protocol.responses import StoredResponse


def input_items(body: ResponsesRequest) -> list[dict]:
    """This request's ``input`` as stored items, each with an id (the client's where it sent one)."""
    if isinstance(body.input, str):
        return [_message(None, "user", [{"type": "input_text", "text": body.input}])]
    return [as_item(item) for item in body.input]


def as_item(item: InputMessage | FunctionCallItem | FunctionCallOutputItem) -> dict:
    """``item`` as it is stored and returned: with an id (the client's where it sent one, else a
    new one), a status, and a message's content as a list of parts."""
    if isinstance(item, FunctionCallItem):
        return {"id": item.id or f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": item.call_id,
                "name": item.name, "arguments": item.arguments, "status": "completed"}
    if isinstance(item, FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else [p.model_dump() for p in item.output]
        return {"id": item.id or f"fco_{uuid.uuid4().hex}", "type": "function_call_output",
                "call_id": item.call_id, "output": output, "status": "completed"}
    kind = "output_text" if item.role == "assistant" else "input_text"
    parts = ([{"type": kind, "text": item.content}] if isinstance(item.content, str)
             else [p.model_dump() for p in item.content])
    return _message(item.id, item.role, parts)


def _message(item_id: str | None, role: str, content: list[dict]) -> dict:
    return {"id": item_id or f"msg_{uuid.uuid4().hex}", "type": "message", "role": role, "status": "completed",
            "content": content}


def items_page(items: list[dict], *, limit: int, order: str, after: str | None) -> dict:
    """A page of ``/input_items``: newest first unless ``order`` is ``asc`` (OpenAI's default is ``desc``)."""
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc, got {order!r}", param="order", code="invalid_value")
    return page(items if order == "asc" else items[::-1], limit=limit, after=after)


def stored(response: dict, items: list[dict], body: ResponsesRequest, *, origin: str | None = None,
           owner: str | None = None) -> StoredResponse:
    """The record of ``response`` (an OpenAI response object) made from ``body`` with ``items``,
    owned by ``owner`` (``ApiKeys.owner``)."""
    return StoredResponse(id=response["id"], created_at=response["created_at"], status=response["status"],
                          response=json.dumps(response), input_items=json.dumps(items),
                          previous_response_id=body.previous_response_id, background=body.background,
                          origin=origin, owner=owner)


def with_status(record: StoredResponse, response: dict, *, origin: str | None = None) -> StoredResponse:
    """The record holding ``response`` (a later state of the same response)."""
    return record.model_copy(update={"status": response["status"], "response": json.dumps(response),
                                     "origin": origin})
