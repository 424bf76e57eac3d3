"""``MetadataStore`` on a NATS KV bucket (``Subjects(namespace).nixl_bucket``, ``tandem-nixl`` by
default). Entries carry no TTL: a
worker deletes its entry on clean shutdown, and a stale entry only costs a failed transfer
(``KVTransferFailed``), after which the writer drops the peer.
"""

from __future__ import annotations

import nats.js.errors
from nats.js.kv import KeyValue

from shared.bus import Bus
from shared.protocol.subjects import Subjects
from shared.transfer.metadata import MetadataStore

DEFAULT_BUCKET = Subjects().nixl_bucket


class NatsMetadataStore(MetadataStore):
    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    @classmethod
    async def open(cls, bus: Bus, bucket: str = DEFAULT_BUCKET) -> "NatsMetadataStore":
        """Bind to the bucket, creating it if it does not exist."""
        return cls(await bus.key_value(bucket))

    async def put(self, worker_id: str, metadata: bytes) -> None:
        await self._kv.put(worker_id, metadata)

    async def get(self, worker_id: str) -> bytes | None:
        try:
            entry = await self._kv.get(worker_id)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return entry.value or None

    async def delete(self, worker_id: str) -> None:
        try:
            await self._kv.purge(worker_id)
        except nats.js.errors.KeyNotFoundError:
            pass
