"""KV transfer: one interface (``KvTransfer``), NIXL behind it, metadata exchange through a store.

``NixlTransfer`` and ``NatsMetadataStore`` are imported from their modules so that importing this
package needs neither NIXL nor NATS.
"""

from shared.transfer.base import (AgentMetadata, KVTransferFailed, KvLayoutMismatch, KvTransfer, TransferError,
                                  TransferHandle, TransferNotification, TransferStats, TransferUnavailable,
                                  joint_runs)
from shared.transfer.metadata import InMemoryMetadataStore, MetadataStore, connect_peer, publish_metadata
from shared.transfer.write import wait_written, write_and_wait

__all__ = [
    "AgentMetadata", "InMemoryMetadataStore", "KVTransferFailed", "KvLayoutMismatch", "KvTransfer",
    "MetadataStore", "TransferError", "TransferHandle", "TransferNotification", "TransferStats",
    "TransferUnavailable", "connect_peer", "joint_runs", "publish_metadata", "wait_written", "write_and_wait",
]
