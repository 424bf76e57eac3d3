"""``MetadataStore`` on a NATS KV bucket (``Subjects(namespace).nixl_bucket``, ``tandem-nixl`` by
default). Entries carry no TTL: a
worker deletes its entry on clean shutdown, and a stale entry only costs a failed transfer
(``KVTransferFailed``), after which the writer drops the peer.
"""

from __future__ import annotations

from shared.bus import Bus, KvBucket
from shared.protocol.subjects import Subjects
from shared.transfer.metadata import MetadataStore

DEFAULT_BUCKET = Subjects().nixl_bucket


class NatsMetadataStore(MetadataStore):
    def __init__(self, kv: KvBucket) -> None:
        self._kv = kv

    @classmethod
    async def open(cls, bus: Bus, bucket: str = DEFAULT_BUCKET) -> "NatsMetadataStore":
        """Bind to the bucket, creating it if it does not exist."""
        return cls(await bus.key_value(bucket))

    async def put(self, worker_id: str, metadata: bytes) -> None:
        await self._kv.put(worker_id, metadata)

    async def get(self, worker_id: str) -> bytes | None:
        return await self._kv.get(worker_id)

    async def delete(self, worker_id: str) -> None:
        await self._kv.delete(worker_id)
