"""Where stored responses live: KV bucket ``responses_bucket``, response id → ``StoredResponse``,
entries expiring after the bucket's TTL. A background response's record changes by
compare-and-set only (queued → in progress → its end, or cancelled), so a cancel from one gateway
and the result from another cannot overwrite each other. Any gateway answers for any response."""

from __future__ import annotations

import json

from shared.bus import Bus, KvBucket
from shared.bus.kv import Versioned
from shared.openai_api.auth import owns
from shared.protocol.responses import StoredResponse
from shared.protocol.subjects import Subjects

# a conversation longer than this many stored turns is refused rather than walked
MAX_TURNS = 1000


class ResponseNotFound(LookupError):
    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


class ResponseStore:
    def __init__(self, records: KvBucket) -> None:
        self._records = records

    @classmethod
    async def open(cls, bus: Bus, subjects: Subjects, *, ttl_s: float) -> "ResponseStore":
        """``ttl_s`` applies when this call creates the bucket; an existing bucket keeps its own."""
        return cls(await bus.key_value(subjects.responses_bucket, ttl_s=ttl_s))

    async def create(self, record: StoredResponse) -> None:
        if not await self._records.create(Subjects.response_key(record.id), record.to_bytes()):
            raise RuntimeError(f"response id {record.id} already exists")

    async def get(self, response_id: str) -> Versioned[StoredResponse] | None:
        """The response and its revision; None if it was never stored, was deleted, expired, or
        the id cannot be one."""
        try:
            key = Subjects.response_key(response_id)
        except ValueError:
            return None
        if (entry := await self._records.entry(key)) is None:
            return None
        return Versioned(StoredResponse.from_bytes(entry[0]), entry[1])

    async def replace(self, current: Versioned[StoredResponse],
                      record: StoredResponse) -> Versioned[StoredResponse] | None:
        """Compare and set: the new version, or None if the record changed (or went) since ``current``."""
        if not await self._records.update(Subjects.response_key(record.id), record.to_bytes(), current.revision):
            return None
        return await self.get(record.id)

    async def delete(self, response_id: str) -> bool:
        """False if there was nothing to delete."""
        if await self.get(response_id) is None:
            return False
        await self._records.delete(Subjects.response_key(response_id))
        return True

    async def conversation(self, response_id: str, owner: str | None = None) -> tuple[StoredResponse, list[dict]]:
        """The response ``response_id`` and the items of its conversation, oldest first: each
        turn's input items, then its output items, back to the first turn. Raises
        ``ResponseNotFound`` naming the first response of the chain that is not stored, or that
        ``owner`` may not see (``owns``; None: every one)."""
        chain: list[StoredResponse] = []
        next_id: str | None = response_id
        while next_id is not None:
            if len(chain) == MAX_TURNS:
                raise RuntimeError(f"conversation of {response_id} has more than {MAX_TURNS} turns")
            if (found := await self.get(next_id)) is None or not owns(owner, found.record.owner):
                raise ResponseNotFound(next_id)
            chain.append(found.record)
            next_id = found.record.previous_response_id
        items: list[dict] = []
        for turn in reversed(chain):
            items += json.loads(turn.input_items) + json.loads(turn.response)["output"]
        return chain[0], items
