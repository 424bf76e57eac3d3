"""The KV transfer of a parallel worker, as its rank 0's services use it: ``KvTransfer``'s interface
over every rank's agent.

A write is an operation of the whole group: every rank writes its pieces (``shared.engine.parallel``
``send_kv``), so it runs in the engine's thread between two steps, where rank 0 talks to its
followers; ``write_blocks`` hands it there and returns at once, and ``poll`` sees it end. Targets
take notifications on rank 0's agent alone (the writer's rank 0 sends one per transfer, after every
rank's writes landed), polled from the caller's thread as for a single process.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence

from shared.transfer.base import AgentMetadata, KVTransferFailed, TransferHandle, TransferNotification, TransferStats
from shared.transfer.relayout import GroupMetadata, plan_pieces
from shared.transfer.write import sleep_until_written

log = logging.getLogger(__name__)


class GroupTransfer:
    """See ``KvTransfer``; ``send(target, local_ids, remote_ids, notify, timeout_s)`` starts one write of
    the whole group in the engine thread and returns its future (``AsyncEngine.send_group_kv``)."""

    def __init__(self, rank0, metadata: GroupMetadata, send: Callable[..., concurrent.futures.Future],
                 *, write_timeout_s: float = 5.0) -> None:
        """``write_timeout_s``: how long each rank waits for its writes before the group gives up
        (the engine's steps wait meanwhile: a target that died costs the group that long)."""
        self._rank0, self._metadata, self._send = rank0, metadata, send
        self.write_timeout_s = write_timeout_s
        self.agent_name = metadata.name
        self.shape = metadata.shape
        self.stats = TransferStats()
        self._peers: dict[str, GroupMetadata] = {}

    def register_kv_pool(self, kv_cache, spec) -> None:
        raise RuntimeError("a parallel worker's pools are registered by its ranks (open_transfer)")

    def local_metadata(self) -> GroupMetadata:
        return self._metadata

    def add_peer(self, metadata: AgentMetadata | GroupMetadata) -> str:
        if isinstance(metadata, AgentMetadata):
            from shared.transfer.relayout import load_target

            metadata = load_target(metadata.to_bytes())
        plan_pieces(self.shape, metadata.shape)  # the same model, or KvLayoutMismatch now
        self._peers[metadata.name] = metadata
        return metadata.name

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def write_blocks(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                     notify: bytes) -> TransferHandle:
        target = self._peers.get(peer)
        if target is None:
            raise KVTransferFailed(f"unknown peer {peer!r} (known: {sorted(self._peers)}): add_peer first")
        future = self._send(target.to_bytes(), list(local_block_ids), list(remote_block_ids), notify,
                            self.write_timeout_s)
        return TransferHandle(peer, 0, 0, notify, backend_handle=future)

    def poll(self, handle: TransferHandle) -> bool:
        if handle.done:
            return True
        future: concurrent.futures.Future = handle.backend_handle
        if not future.done():
            return False
        try:
            handle.num_bytes, handle.num_descriptors = future.result()
        except Exception as exc:  # noqa: BLE001 - a rank's failure, or the engine's
            self.stats.num_failed += 1
            if isinstance(exc, KVTransferFailed):
                raise
            raise KVTransferFailed(f"write to {handle.peer!r} failed: {exc}") from exc
        handle.done = True
        self.stats.num_transfers += 1
        self.stats.num_bytes_sent += handle.num_bytes
        self.stats.num_descriptors += handle.num_descriptors
        return True

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        sleep_until_written(self, handle, timeout_s, first_pause_s=1e-4)

    def cancel(self, handle: TransferHandle) -> None:
        """The group's write goes on to its own deadline (its ranks cannot be stopped mid-way); its
        notification is what the target waits for, so a cancelled write is one it never counts."""
        if not handle.done:
            self.stats.num_failed += 1
            handle.done = True

    def get_notifications(self) -> list[TransferNotification]:
        notes = self._rank0.get_notifications()
        self.stats.num_bytes_received = self._rank0.stats.num_bytes_received
        return notes

    def close(self) -> None:
        self._rank0.close()
