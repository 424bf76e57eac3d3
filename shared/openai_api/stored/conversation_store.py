"""Where conversations live: KV bucket ``conversations_bucket`` (no TTL: OpenAI keeps a
conversation until it is deleted). Under ``conversation_key`` the ``StoredConversation`` (metadata,
owner, the ids of its items in order), changed by compare-and-set only, so two gateways adding to
one conversation at once both land; under ``conversation_item_key`` each item.

An item is written before the record lists it and removed after the record stops listing it, so
every id a reader finds in the record has its item (a reader that raced a delete of the whole
conversation skips the items already gone). A gateway that dies between the two steps leaves an
item that no record lists: unreachable, and removed with its conversation only if it is listed
then; a small leak, never a wrong answer."""

from __future__ import annotations

import asyncio
import json

from shared.bus import Bus, KvBucket
from shared.bus.kv import Versioned
from shared.openai_api.stored.conversations import check_new_items
from shared.protocol.conversations import StoredConversation, StoredConversationItem
from shared.protocol.subjects import Subjects

_CAS_TRIES = 20          # concurrent writers of one conversation: each try loses only to a write that landed
_READ_CONCURRENCY = 64


class ConversationStore:
    def __init__(self, records: KvBucket) -> None:
        self._records = records

    @classmethod
    async def open(cls, bus: Bus, subjects: Subjects) -> "ConversationStore":
        return cls(await bus.key_value(subjects.conversations_bucket))

    async def create(self, record: StoredConversation, items: list[dict]) -> StoredConversation:
        """Store a new conversation holding ``items`` (each with its ``id``; ``check_new_items``
        first); its record as stored."""
        record = record.model_copy(update={"item_ids": tuple(item["id"] for item in items)})
        await self._put_items(record.id, items)
        if not await self._records.create(Subjects.conversation_key(record.id), record.to_bytes()):
            raise RuntimeError(f"conversation id {record.id} already exists")
        return record

    async def get(self, conversation_id: str) -> Versioned[StoredConversation] | None:
        """The conversation and its revision; None if there is none, or the id cannot be one."""
        try:
            key = Subjects.conversation_key(conversation_id)
        except ValueError:
            return None
        if (entry := await self._records.entry(key)) is None:
            return None
        return Versioned(StoredConversation.from_bytes(entry[0]), entry[1])

    async def set_metadata(self, conversation_id: str, metadata: dict[str, str]) -> StoredConversation | None:
        """The conversation with ``metadata`` in place of its own; None if it is gone."""
        return await self._change(conversation_id, lambda r: r.model_copy(update={"metadata": metadata}))

    async def append(self, conversation_id: str, items: list[dict]) -> StoredConversation | None:
        """Add ``items`` at the end; None if the conversation is gone. Raises the 400 of
        ``check_new_items`` when they cannot be added (checked again on every try: a writer
        that got there first may have added the same id)."""
        def added(record: StoredConversation) -> StoredConversation:
            check_new_items(record, items, "items")
            return record.model_copy(update={"item_ids": record.item_ids + tuple(item["id"] for item in items)})

        if (current := await self.get(conversation_id)) is None:
            return None
        added(current.record)  # refused before anything is written
        await self._put_items(conversation_id, items)
        if (record := await self._change(conversation_id, added)) is None:
            await self._delete_items(conversation_id, [item["id"] for item in items])
        return record

    async def remove_item(self, conversation_id: str, item_id: str) -> StoredConversation | None:
        """The conversation without ``item_id``; None if the conversation is gone or does not hold
        the item."""
        def without(record: StoredConversation) -> StoredConversation | None:
            if item_id not in record.item_ids:
                return None
            return record.model_copy(update={"item_ids": tuple(i for i in record.item_ids if i != item_id)})

        if (record := await self._change(conversation_id, without)) is not None:
            await self._delete_items(conversation_id, [item_id])
        return record

    async def delete(self, conversation_id: str) -> bool:
        """The conversation and its items; False if there was nothing to delete."""
        if (current := await self.get(conversation_id)) is None:
            return False
        await self._records.delete(Subjects.conversation_key(conversation_id))
        await self._delete_items(conversation_id, list(current.record.item_ids))
        return True

    async def item(self, conversation_id: str, item_id: str) -> dict | None:
        """One item of the conversation as OpenAI returns it; None if it holds none by that id."""
        try:
            key = Subjects.conversation_item_key(conversation_id, item_id)
        except ValueError:
            return None
        if (value := await self._records.get(key)) is None:
            return None
        stored = StoredConversationItem.from_bytes(value)
        return json.loads(stored.item) if stored.id == item_id else None

    async def items(self, conversation_id: str, item_ids: list[str] | tuple[str, ...]) -> list[dict]:
        """The items of ``item_ids`` (ids the conversation's record lists), in that order; any
        removed since the record was read left out."""
        limit = asyncio.Semaphore(_READ_CONCURRENCY)

        async def read(item_id: str) -> dict | None:
            async with limit:
                return await self.item(conversation_id, item_id)

        return [item for item in await asyncio.gather(*(read(i) for i in item_ids)) if item is not None]

    async def _change(self, conversation_id: str, change) -> StoredConversation | None:
        """Compare and set ``change(record)`` until it lands; None if the conversation is gone or
        ``change`` returns None."""
        for _ in range(_CAS_TRIES):
            if (current := await self.get(conversation_id)) is None:
                return None
            if (record := change(current.record)) is None:
                return None
            if await self._records.update(Subjects.conversation_key(conversation_id), record.to_bytes(),
                                          current.revision):
                return record
        raise RuntimeError(f"conversation {conversation_id} changed {_CAS_TRIES} times while it was written")

    async def _put_items(self, conversation_id: str, items: list[dict]) -> None:
        for item in items:
            stored = StoredConversationItem(id=item["id"], conversation_id=conversation_id, item=json.dumps(item))
            await self._records.put(Subjects.conversation_item_key(conversation_id, item["id"]), stored.to_bytes())

    async def _delete_items(self, conversation_id: str, item_ids: list[str]) -> None:
        for item_id in item_ids:
            await self._records.delete(Subjects.conversation_item_key(conversation_id, item_id))
