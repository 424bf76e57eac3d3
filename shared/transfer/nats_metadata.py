"""``MetadataStore`` on a NATS KV bucket (``<namespace>-nixl``; ``tandem-nixl`` by default).

shared/bus has no general KV-bucket helper (``WorkerRegistry`` is specific to WorkerInfo), so this
module binds the bucket through the Bus's JetStream context itself. Entries carry no TTL: a
worker deletes its entry on clean shutdown, and a stale entry only costs a failed transfer
(``KVTransferFailed``), after which the writer drops the peer.
"""

from __future__ import annotations

import nats.js.errors
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from shared.bus import Bus
from shared.transfer.metadata import MetadataStore

DEFAULT_BUCKET = "tandem-nixl"


def nixl_bucket(namespace: str) -> str:
    """The bucket of a namespace, alongside ``<namespace>-workers``."""
    return f"{namespace}-nixl"


class NatsMetadataStore(MetadataStore):
    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    @classmethod
    async def open(cls, bus: Bus, bucket: str = DEFAULT_BUCKET) -> "NatsMetadataStore":
        """Bind to the bucket, creating it if it does not exist."""
        try:
            kv = await bus.js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            try:
                kv = await bus.js.create_key_value(KeyValueConfig(bucket=bucket, history=1))
            except nats.js.errors.BadRequestError:  # created concurrently by another process
                kv = await bus.js.key_value(bucket)
        return cls(kv)

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
