"""A JetStream Object Store bucket behind our own small API, in the style of ``kv.py``: objects
are bytes with a short text description, a missing or deleted object reads as None, deleting a
missing object is no error.

nats-py's ``get`` appends every chunk to one ``bytes`` (quadratic in the object's size) and its
``list`` runs a watcher that may report the end before an object just written: reads here go
through a buffer, and the listing comes from the bucket's stream state, server side (as
``KvBucket.items``)."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, ObjectMeta
from nats.js.object_store import ObjectStore


@dataclass(frozen=True)
class StoredObject:
    name: str
    size: int
    description: str  # what the writer put there (e.g. a JSON record); "" if nothing


class ObjectBucket:
    def __init__(self, store: ObjectStore, js: JetStreamContext, bucket: str) -> None:
        self._store = store
        self._js = js
        self._bucket = bucket

    async def put(self, name: str, data: bytes, description: str = "") -> StoredObject:
        """Store ``data`` under ``name``, replacing any object of that name whole: a reader sees
        the old object or the new one, never a mix (the meta message is written last)."""
        info = await self._store.put(name, io.BytesIO(data), ObjectMeta(name=name, description=description))
        return _stored(info)

    async def info(self, name: str) -> StoredObject | None:
        try:
            return _stored(await self._store.get_info(name))
        except nats.js.errors.ObjectNotFoundError:
            return None

    async def get(self, name: str) -> bytes | None:
        """The object's bytes; None if it does not exist (or was deleted)."""
        buffer = io.BytesIO()
        try:
            await self._store.get(name, writeinto=buffer)
        except nats.js.errors.ObjectNotFoundError:
            return None
        return buffer.getvalue()

    async def delete(self, name: str) -> bool:
        """Remove the object and its chunks; False if there was none (idempotent)."""
        try:
            await self._store.delete(name)
        except nats.js.errors.ObjectNotFoundError:
            return False
        return True

    async def list(self) -> list[StoredObject]:
        """Every object that exists now (deleted ones left out), in no particular order."""
        prefix = f"$O.{self._bucket}.M."  # the object store convention: one meta subject per object
        info = await self._js.stream_info(f"OBJ_{self._bucket}", subjects_filter=f"{prefix}>")
        found = []
        for subject in info.state.subjects or {}:
            name = base64.urlsafe_b64decode(subject.removeprefix(prefix)).decode()
            if (obj := await self.info(name)) is not None:
                found.append(obj)
        return found


def _stored(info: ObjectInfo) -> StoredObject:
    return StoredObject(name=info.name, size=info.size or 0, description=info.description or "")
