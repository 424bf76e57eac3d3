"""Where agents publish their metadata and find each other's: a small store keyed by worker id.

The decode worker (the write target) publishes its ``AgentMetadata`` at startup; a prefill worker
looks a target up by the worker id named in the RemotePrefillRequest and adds it as a peer once.
"""

from __future__ import annotations

import abc
import asyncio
import time

from shared.transfer.base import KvTransfer, KVTransferFailed


class MetadataStore(abc.ABC):
    """Agent metadata by worker id. Values are opaque bytes (``AgentMetadata.to_bytes``)."""

    @abc.abstractmethod
    async def put(self, worker_id: str, metadata: bytes) -> None:
        """Publish or replace the worker's metadata."""

    @abc.abstractmethod
    async def get(self, worker_id: str) -> bytes | None:
        """The worker's latest metadata, or None if it has none (never published, or deleted)."""

    @abc.abstractmethod
    async def delete(self, worker_id: str) -> None:
        """Withdraw the worker's metadata (clean shutdown); unknown ids are ignored."""


class InMemoryMetadataStore(MetadataStore):
    """For tests and single-process setups."""

    def __init__(self) -> None:
        self._entries: dict[str, bytes] = {}

    async def put(self, worker_id: str, metadata: bytes) -> None:
        self._entries[worker_id] = bytes(metadata)

    async def get(self, worker_id: str) -> bytes | None:
        return self._entries.get(worker_id)

    async def delete(self, worker_id: str) -> None:
        self._entries.pop(worker_id, None)


async def publish_metadata(store: MetadataStore, worker_id: str, transfer: KvTransfer) -> None:
    await store.put(worker_id, transfer.local_metadata().to_bytes())


async def connect_peer(store: MetadataStore, worker_id: str, transfer: KvTransfer, *,
                       timeout_s: float = 0.0) -> str:
    """Look ``worker_id`` up and add it as a peer (a no-op for unchanged metadata); returns the peer
    name for ``write_blocks``. Waits up to ``timeout_s`` for metadata not published yet, then
    raises ``KVTransferFailed``."""
    deadline = time.monotonic() + timeout_s
    while (data := await store.get(worker_id)) is None:
        if time.monotonic() >= deadline:
            raise KVTransferFailed(f"worker {worker_id!r} has published no transfer metadata")
        await asyncio.sleep(0.02)
    from shared.transfer.relayout import load_target

    return transfer.add_peer(load_target(data))

