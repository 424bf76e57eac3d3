"""Conversations (OpenAI's Conversations API) as they are kept in NATS: one KV entry per
conversation, holding its metadata and the ids of its items in order, and one entry per item. An
item is OpenAI JSON and travels as JSON text, never as an open dict."""

from __future__ import annotations

from pydantic import Field

from shared.protocol.base import WireModel


class StoredConversation(WireModel):
    """A conversation: ``item_ids`` in the order the items were added (oldest first), each item
    kept under its own key (``Subjects.conversation_item_key``) so that this record stays small
    however long the conversation gets. Changed by compare-and-set only."""

    id: str
    created_at: int
    metadata: dict[str, str] = Field(default_factory=dict)
    item_ids: tuple[str, ...] = ()
    owner: str | None = None                 # as FileRecord.owner (shared.protocol.batch)


class StoredConversationItem(WireModel):
    """One item of a conversation: ``item`` is the OpenAI item object (JSON) as it is returned."""

    id: str
    conversation_id: str
    item: str
