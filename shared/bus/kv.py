"""A JetStream KV bucket behind our own small API: values are bytes, a missing or deleted key
reads as None, deleting a missing key is no error."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

R = TypeVar("R")


@dataclass(frozen=True)
class Versioned(Generic[R]):
    """A KV record as read, with the revision a compare-and-set names."""

    record: R
    revision: int


class KvBucket:
    def __init__(self, kv: KeyValue, js: JetStreamContext, bucket: str) -> None:
        self._kv = kv
        self._js = js
        self._bucket = bucket

    async def put(self, key: str, value: bytes) -> None:
        await self._kv.put(key, value)

    async def create(self, key: str, value: bytes) -> bool:
        """Put ``value`` only if the key holds none: True if this call stored it, False if the key
        already had a value (the caller lost a race, or did it before: an idempotent write)."""
        try:
            await self._kv.create(key, value)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        return True

    async def entry(self, key: str) -> tuple[bytes, int] | None:
        """The key's value and its revision (for ``update``); None if it has none."""
        try:
            entry = await self._kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return (entry.value, entry.revision) if entry.value else None

    async def update(self, key: str, value: bytes, revision: int) -> bool:
        """Compare and set: put ``value`` only if the key's revision is still ``revision``; False
        if another writer changed it since (read it again and decide again)."""
        try:
            await self._kv.update(key, value, last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        return True

    async def get(self, key: str) -> bytes | None:
        """The key's value; None if it is missing, deleted or expired (an empty value too)."""
        try:
            entry = await self._kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return entry.value or None

    async def revision(self, key: str) -> int | None:
        """The revision of the key's current value (a put makes a new one); None if it has none."""
        try:
            return (await self._kv.get(key)).revision
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None

    async def watch(self, key: str) -> AsyncIterator[bytes | None]:
        """The key's value now (if it has one), then each new one as it is put, and None for each
        delete; however quickly they follow each other. Closing the iterator stops the watch."""
        watcher = await self._kv.watch(key)
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=3600)
                except nats.errors.TimeoutError:
                    continue
                if entry is None:  # the end of the current values
                    continue
                yield None if entry.operation in (KV_DEL, KV_PURGE) else entry.value
        finally:
            with contextlib.suppress(nats.errors.Error):
                await watcher.stop()

    async def delete(self, key: str) -> None:
        """Remove the key and its history (idempotent)."""
        try:
            await self._kv.purge(key)
        except nats.js.errors.KeyNotFoundError:
            pass

    async def keys(self) -> list[str]:
        """Keys that hold a value now."""
        return [key for key, _ in await self.items()]

    async def count(self, prefix: str) -> int:
        """How many keys ``<prefix>.*`` (any depth) were ever written: one server-side request, the
        values unread. A key removed by ``delete`` keeps a marker and still counts: for buckets
        whose keys are written once and removed only with all their siblings."""
        info = await self._js.stream_info(f"KV_{self._bucket}",
                                          subjects_filter=f"$KV.{self._bucket}.{prefix}.>")
        return len(info.state.subjects or {})

    async def items_under(self, prefix: str) -> list[tuple[str, bytes]]:
        """(key, value) of every key ``<prefix>.*`` (any depth) that holds a value now."""
        return await self.items(f"{prefix}.>")

    async def items(self, pattern: str = ">") -> list[tuple[str, bytes]]:
        """(key, value) of every key that holds a value now. The candidate keys come from the
        bucket's stream state, server side: nats-py's ``keys()`` runs a watcher that can report the
        end of the keys before a key just written arrives (a registry read right after a put
        then missed the entry). ``pattern``: only keys matching it (NATS wildcards)."""
        prefix = f"$KV.{self._bucket}."  # the KV convention: stream KV_<bucket>, one subject per key
        info = await self._js.stream_info(f"KV_{self._bucket}", subjects_filter=f"{prefix}{pattern}")
        found = []
        for key in (subject.removeprefix(prefix) for subject in (info.state.subjects or {})):
            if (value := await self.get(key)) is not None:  # a delete marker or expired: skip
                found.append((key, value))
        return found

    async def ttl_s(self) -> float | None:
        """How long entries live (the bucket's ``max_age``); None: forever."""
        return (await self._kv.status()).ttl or None

    async def watch_all(self):
        """A nats KV watcher over every key (for ``shared.bus.registry``; stays inside the bus)."""
        return await self._kv.watchall()
