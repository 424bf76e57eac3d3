"""The KV transfer interface: move a request's KV blocks from this process's pool into a peer's.

A pool is one contiguous tensor ``[num_blocks, num_layers, 2, block_size, Hkv, D]`` (see
shared/kvcache/layout.py): a block is one contiguous row holding every layer's K and V. A write
therefore needs at most one descriptor per *joint run*: a stretch of local block ids that are
consecutive and whose remote ids are consecutive too. A long prompt in a fresh pool is a handful
of descriptors, never one per 16-token page per layer.

Transfers are one-sided WRITEs started by the side that holds the KV (the prefill worker). The
target learns that a write landed only through the notification that follows it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from shared.kvcache.layout import KvCacheSpec


class TransferError(Exception):
    code = "transfer_error"


class KVTransferFailed(TransferError):
    """A write could not be started or did not complete: unknown peer, block ids out of range,
    a backend error, a peer gone mid-transfer, or no completion before the deadline."""

    code = "kv_transfer_failed"


class KvLayoutMismatch(KVTransferFailed):
    """The two pools' layouts differ in a way no conversion covers (layers, heads, head_dim)."""

    code = "kv_layout_mismatch"


class TransferUnavailable(TransferError):
    """The transfer backend cannot be used on this platform (``nixl`` not importable, no UCX).
    Services report it at startup and refuse remote prefill; nothing silently degrades."""

    code = "transfer_unavailable"


# --- the description of a pool that a peer needs to write into it --------------------------------
def spec_to_dict(spec: KvCacheSpec) -> dict:
    return {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "block_size": spec.block_size, "dtype": str(spec.dtype).removeprefix("torch.")}


def spec_from_dict(d: dict) -> KvCacheSpec:
    dtype = getattr(torch, d["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise KvLayoutMismatch(f"peer pool has unknown dtype {d['dtype']!r}")
    return KvCacheSpec(int(d["num_layers"]), int(d["num_kv_heads"]), int(d["head_dim"]),
                       int(d["block_size"]), dtype)


def describe_spec(spec: KvCacheSpec) -> str:
    return (f"[blocks, {spec.num_layers} layers, 2, {spec.block_size} tokens, {spec.num_kv_heads} heads, "
            f"{spec.head_dim}] {str(spec.dtype).removeprefix('torch.')}")


@dataclass(frozen=True)
class AgentMetadata:
    """What a peer publishes so others can write into its pool: the backend's own connection and
    registration blob plus where the pool lives and how it is laid out."""

    agent_name: str
    backend_metadata: bytes  # opaque, from the backend (NIXL: the agent's local metadata)
    pool_address: int
    num_blocks: int
    spec: KvCacheSpec
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int

    @property
    def block_bytes(self) -> int:
        return self.spec.bytes_per_block

    def to_bytes(self) -> bytes:
        return json.dumps({
            "agent_name": self.agent_name, "backend_metadata": base64.b64encode(self.backend_metadata).decode(),
            "pool_address": self.pool_address, "num_blocks": self.num_blocks, "spec": spec_to_dict(self.spec),
            "mem_type": self.mem_type, "device_id": self.device_id}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "AgentMetadata":
        try:
            d = json.loads(data)
            return cls(d["agent_name"], base64.b64decode(d["backend_metadata"]), int(d["pool_address"]),
                       int(d["num_blocks"]), spec_from_dict(d["spec"]), d["mem_type"], int(d["device_id"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise KVTransferFailed(f"malformed agent metadata: {exc}") from exc


# --- handles, notifications, counters ------------------------------------------------------------
@dataclass
class TransferHandle:
    """One write in flight. ``num_descriptors`` is what the backend was asked to move (one per
    joint run on the fast path); ``num_bytes`` is the payload written into the peer's pool."""

    peer: str
    num_bytes: int
    num_descriptors: int
    notify: bytes
    done: bool = False
    backend_descriptors: int | None = None  # the backend's own count, when it reports one
    backend_handle: object = field(default=None, repr=False)
    resources: list = field(default_factory=list, repr=False)  # kept alive until done (staging)
    then_notify: bytes | None = None  # sent once every part landed (a write of several parts)


@dataclass(frozen=True)
class TransferNotification:
    peer: str  # the writer's agent name
    message: bytes  # the ``notify`` bytes the writer passed to write_blocks
    num_bytes: int  # bytes that write put into this pool


@dataclass
class TransferStats:
    num_bytes_sent: int = 0  # completed writes from this process
    num_bytes_received: int = 0  # writes into this pool whose notification arrived
    num_transfers: int = 0  # completed writes
    num_descriptors: int = 0  # descriptors of completed writes
    num_failed: int = 0


def joint_runs(local_block_ids: Sequence[int], remote_block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pair block ids position by position and merge stretches where both sides are consecutive:
    ``(first_local, first_remote, num_blocks)`` per run, in order. Each run is one descriptor."""
    if len(local_block_ids) != len(remote_block_ids):
        raise KVTransferFailed(f"{len(local_block_ids)} local block ids for {len(remote_block_ids)} remote ones")
    runs: list[tuple[int, int, int]] = []
    for local, remote in zip(local_block_ids, remote_block_ids):
        if runs and runs[-1][0] + runs[-1][2] == local and runs[-1][1] + runs[-1][2] == remote:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((local, remote, 1))
    return runs


@runtime_checkable
class KvTransfer(Protocol):
    """Moves KV blocks between pools of different processes (or machines) with one-sided writes.

    Life cycle: ``register_kv_pool`` once; ``local_metadata()`` published for peers (see
    ``MetadataStore``); ``add_peer(metadata)`` for each peer to write to; then any number of
    ``write_blocks`` + ``wait``/``poll``. The target side calls ``get_notifications`` to learn which
    writes landed. Not thread-safe: call from one thread (the service's event loop thread).
    """

    agent_name: str
    stats: TransferStats

    def register_kv_pool(self, kv_cache: torch.Tensor, spec: KvCacheSpec) -> None:
        """Register the whole pool (one contiguous tensor, CPU → DRAM, CUDA → VRAM) once, before
        ``local_metadata``. The tensor must stay alive and must not move for the agent's lifetime.
        Registering a second pool raises."""

    def local_metadata(self) -> AgentMetadata:
        """What a peer needs to write into this pool; requires a registered pool."""

    def add_peer(self, metadata: AgentMetadata) -> str:
        """Load a peer's metadata and prepare the descriptors of its pool once; returns the peer
        name to pass to ``write_blocks``. Adding a peer again with new metadata (a restarted worker
        under the same name) replaces the old entry. Raises ``KvLayoutMismatch`` if no conversion
        from this pool's layout to the peer's exists."""

    def remove_peer(self, peer: str) -> None:
        """Forget a peer and release its prepared descriptors; unknown names are ignored."""

    def write_blocks(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                     notify: bytes) -> TransferHandle:
        """Start writing the blocks ``local_block_ids`` of this pool into ``remote_block_ids`` of the
        peer's pool (paired by position) and send ``notify`` to the peer once all bytes landed.

        Same layout on both sides: equal lengths, one descriptor per joint run. Different block size
        or dtype: the local blocks hold the tokens in order; they are converted in a staging slab and
        ``remote_block_ids`` must be exactly the blocks those tokens fill on the peer (every remote
        block is written whole; the tail past the tokens is zeros).

        Writing the same blocks again is harmless (same bytes, one more notification). Raises
        ``KVTransferFailed`` for an unknown peer, ids out of range, or a backend error. The caller
        must not free or overwrite the local blocks before the handle is done."""

    def poll(self, handle: TransferHandle) -> bool:
        """True once the write completed (counters updated); False while in flight; raises
        ``KVTransferFailed`` if it failed."""

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        """Poll until done; raises ``KVTransferFailed`` on failure or after ``timeout_s``. After a
        timeout the write is cancelled if the backend can; the target must treat the destination
        blocks as possibly written (it never counts them as filled without the notification)."""

    def cancel(self, handle: TransferHandle) -> None:
        """Give up on a write not yet done: cancel it if the backend can and count it failed. As
        after a ``wait`` timeout, the target treats the destination blocks as possibly written."""

    def get_notifications(self) -> list[TransferNotification]:
        """Notifications that arrived since the last call, each once, in arrival order per peer.
        A target calls this regularly (every loop iteration or few ms) while it expects writes: it
        also drives the backend's progress, which accepting a new peer's connection needs when the
        backend runs no progress thread of its own."""

    def close(self) -> None:
        """Release prepared descriptors and registrations. In-flight writes must be done first."""
