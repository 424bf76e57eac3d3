"""Conversations of OpenAI's Conversations API as OpenAI returns them, and the checks on items
added to one. Pure: no bus (``shared.openai_api.stored.conversation_store`` keeps them)."""

from __future__ import annotations

import json
import time
import uuid

from shared.openai_api.errors import ApiError
from shared.protocol.conversations import StoredConversation

# an item is one NATS message (1 MiB by default)
MAX_ITEM_BYTES = 768 << 10
# the record lists every item id (~40 bytes each): it stays well under one NATS message
MAX_ITEMS = 10_000


def new_conversation(metadata: dict[str, str] | None, owner: str | None,
                     now: float | None = None) -> StoredConversation:
    return StoredConversation(id=f"conv_{uuid.uuid4().hex}", created_at=int(time.time() if now is None else now),
                              metadata=metadata or {}, owner=owner)


def conversation_object(record: StoredConversation) -> dict:
    return {"id": record.id, "object": "conversation", "created_at": record.created_at,
            "metadata": dict(record.metadata)}


def deleted_object(conversation_id: str) -> dict:
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


def check_new_items(record: StoredConversation, items: list[dict], param: str) -> None:
    """A 400 naming the problem when ``items`` cannot be added to ``record``: an id already in the
    conversation or twice among them (OpenAI: "Duplicate item found"), an item too large to store,
    or a conversation that would grow past ``MAX_ITEMS``."""
    seen = set(record.item_ids)
    for i, item in enumerate(items):
        if item["id"] in seen:
            raise ApiError(400, f"Duplicate item found with id {item['id']!r}: it is already in conversation "
                           f"{record.id!r}. Remove duplicate items from your input and try again.",
                           param=f"{param}[{i}].id", code="duplicate_item")
        seen.add(item["id"])
        if (size := len(json.dumps(item))) > MAX_ITEM_BYTES:
            raise ApiError(400, f"{param}[{i}] is too large to store ({size} bytes, at most {MAX_ITEM_BYTES})",
                           param=f"{param}[{i}]", code="input_too_large")
    if (total := len(record.item_ids) + len(items)) > MAX_ITEMS:
        raise ApiError(400, f"conversation {record.id!r} would hold {total} items, at most {MAX_ITEMS}; "
                       f"start a new conversation", param=param, code="conversation_too_long")
