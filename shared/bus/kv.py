"""A JetStream KV bucket behind our own small API: values are bytes, a missing or deleted key
reads as None, deleting a missing key is no error."""

from __future__ import annotations

import nats.js.errors
from nats.js.kv import KeyValue


class KvBucket:
    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def put(self, key: str, value: bytes) -> None:
        await self._kv.put(key, value)

    async def get(self, key: str) -> bytes | None:
        """The key's value; None if it is missing, deleted or expired (an empty value too)."""
        try:
            entry = await self._kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return entry.value or None

    async def delete(self, key: str) -> None:
        """Remove the key and its history (idempotent)."""
        try:
            await self._kv.purge(key)
        except nats.js.errors.KeyNotFoundError:
            pass

    async def keys(self) -> list[str]:
        try:
            return await self._kv.keys()
        except nats.js.errors.NoKeysError:
            return []

    async def ttl_s(self) -> float | None:
        """How long entries live (the bucket's ``max_age``); None: forever."""
        return (await self._kv.status()).ttl or None

    async def watch_all(self):
        """A nats KV watcher over every key (for ``shared.bus.registry``; stays inside the bus)."""
        return await self._kv.watchall()
