"""KvTransfer over NIXL (UCX backend): DRAM pools on CPU, VRAM pools on CUDA.

Descriptors are prepared once: the local pool as one descriptor per block when the pool is
registered, each peer's pool likewise when the peer is added. A write selects blocks by index and
NIXL merges entries that are consecutive on both sides, so it moves one descriptor per joint run
(``joint_runs``), which the tests check against NIXL's own telemetry.

Notifications carry a small header with the number of bytes the write moved, so the target can
count received bytes (a one-sided write is otherwise invisible to it).

Between workers of different parallel shapes (``shared.transfer.relayout``) an agent is one rank
of its group: it writes its pieces of the plan into the target ranks' agents, from its pool where a
piece's bytes are one run there and staged in the target rank's layout where heads split, and the
notification goes to the target's rank 0 once every piece landed.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.dispatch import gather_kv_blocks
from shared.kvcache.layout import KvCacheSpec, contiguous_runs
from shared.transfer.base import (AgentMetadata, KVTransferFailed, KvLayoutMismatch, TransferHandle,
                                  TransferNotification, TransferStats, TransferUnavailable, describe_spec, joint_runs)
from shared.transfer.convert import check_convertible, convert_slab, needs_conversion
from shared.transfer.relayout import Gathered, GroupMetadata, KvShape, Piece, plan_pieces, region_runs
from shared.transfer.write import sleep_until_written

log = logging.getLogger(__name__)

_NOTIFY_MAGIC = b"TKV1"
_NOTIFY_HEADER = struct.Struct("<4sQ")  # magic, bytes written


def load_nixl():
    """The NIXL Python API module, or ``TransferUnavailable`` saying why it cannot be used."""
    errors = []
    for module in ("nixl_cu12._api", "nixl._api"):
        try:
            return __import__(module, fromlist=["nixl_agent"])
        except Exception as exc:  # noqa: BLE001 - a broken native library raises more than ImportError
            errors.append(f"{module}: {exc}")
    raise TransferUnavailable("NIXL is not importable on this platform (" + "; ".join(errors) + "): remote "
                              "prefill is unavailable; install nixl-cu12 (Linux x86_64/aarch64)")


def _block_descs(base: int, num_blocks: int, block_bytes: int, device_id: int) -> np.ndarray:
    """[num_blocks, 3] uint64 rows (address, nbytes, device id): one descriptor per block."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    descs[:, 1] = block_bytes
    descs[:, 2] = device_id
    return descs


@dataclass(eq=False)  # compared by identity (a field-wise == would compare the buffers)
class _Slab:
    """A staging buffer registered once with the agent and reused by later writes."""

    buffer: torch.Tensor  # uint8
    registration: object


_MAX_FREE_SLAB_BYTES = 512 << 20  # staging kept registered between writes, at most


@dataclass
class _Peer:
    name: str
    metadata: AgentMetadata
    blocks: object  # prepped dlist handle: one descriptor per block of the peer's pool


class NixlTransfer:
    """See ``KvTransfer``. One NIXL agent per process (per worker)."""

    def __init__(self, agent_name: str, *, backends: Sequence[str] = ("UCX",), progress_thread: bool = False,
                 capture_telemetry: bool = False, backend_params: dict[str, str] | None = None,
                 thread_safe: bool = False) -> None:
        """``progress_thread``: NIXL's own progress thread polls without pause and keeps a core busy
        even when idle (measured: 3 idle agents took 0.7 of a core here), which a 2-core CPU host
        cannot spare. Without it, ``poll``/``wait`` and ``get_notifications`` drive progress, which
        is all a one-sided write needs. Turn it on where cores are plentiful (GPU servers).

        ``backend_params``: init parameters for every backend, e.g. UCX's
        ``{"ucx_error_handling_mode": "none"}``. NIXL's default ("peer") detects a dead peer; no
        shared-memory transport supports that, so on one host UCX sends its active messages
        (connection setup, notifications) over TCP loopback while the DRAM writes themselves go
        through CMA. "none" allows shared memory for both but loses the detection; on this project's
        2-core host both move KV at the same speed (loadtest/bench/kv_transfer.py --error-modes).

        ``thread_safe``: the agent serializes its calls (NIXL's strict sync mode), for a rank of a
        parallel worker whose agent is polled by one thread and written from another."""
        api = load_nixl()
        try:
            sync = {"sync_mode": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT} if thread_safe else {}
            config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[],
                                           capture_telemetry=capture_telemetry, **sync)
            self._agent = api.nixl_agent(agent_name, config)
            for backend in backends:
                if backend in self._agent.plugin_list:
                    self._agent.create_backend(backend, dict(backend_params or {}))
        except Exception as exc:  # noqa: BLE001
            raise TransferUnavailable(f"cannot start NIXL agent {agent_name!r} with {list(backends)}: {exc}") from exc
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise TransferUnavailable(f"NIXL backend(s) {missing} unavailable (plugins: {self._agent.plugin_list})")
        self.agent_name = agent_name
        self._capture_telemetry = capture_telemetry
        self.stats = TransferStats()
        self._peers: dict[str, _Peer] = {}  # by agent name: every target rank added
        self._groups: dict[str, GroupMetadata] = {}  # by peer name (a group's rank 0 agent)
        self._pool: torch.Tensor | None = None
        self._spec: KvCacheSpec | None = None
        self.shape: KvShape | None = None  # this agent's worker (a group of one unless a rank of a parallel worker)
        self.rank = 0
        self._registration = None
        self._local_blocks = None
        self._free_slabs: list[_Slab] = []  # staging of re-laid-out writes, registered, not in use

    # -- setup ------------------------------------------------------------------------------------
    def register_kv_pool(self, kv_cache: torch.Tensor, spec: KvCacheSpec, *, shape: KvShape | None = None,
                         rank: int = 0) -> None:
        """(See ``KvTransfer``.) ``shape`` and ``rank``: the pool is world rank ``rank``'s shard of a
        parallel worker of that shape (its layers and heads, ``KvShape``); default a whole pool."""
        if self._pool is not None:
            raise RuntimeError(f"agent {self.agent_name} already has a registered KV pool")
        expected = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        if not kv_cache.is_contiguous() or tuple(kv_cache.shape[1:]) != expected or kv_cache.dtype != spec.dtype:
            raise ValueError(f"KV pool {tuple(kv_cache.shape)} {kv_cache.dtype} is not a contiguous "
                             f"[blocks, *{expected}] {spec.dtype} tensor")
        self.shape = shape or KvShape(1, 1, spec.num_layers, spec.num_kv_heads)
        self.rank = rank
        if (len(self.shape.layers(rank)), len(self.shape.heads(rank))) != (spec.num_layers, spec.num_kv_heads):
            raise ValueError(f"a pool of {spec.num_layers} layers and {spec.num_kv_heads} KV heads is not rank {rank}'s "
                             f"shard of {self.shape.describe()}")
        self._registration = self._agent.register_memory(kv_cache)
        self._pool, self._spec = kv_cache, spec
        self._local_blocks = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _block_descs(kv_cache.data_ptr(), kv_cache.shape[0], spec.bytes_per_block,
                                            self._device_id), self._mem_type)

    @property
    def _mem_type(self) -> str:
        assert self._pool is not None, "register_kv_pool first"
        return "VRAM" if self._pool.is_cuda else "DRAM"

    @property
    def _device_id(self) -> int:
        assert self._pool is not None, "register_kv_pool first"
        return self._pool.get_device() if self._pool.is_cuda else 0

    def local_metadata(self) -> AgentMetadata:
        assert self._pool is not None and self._spec is not None, "register_kv_pool first"
        return AgentMetadata(self.agent_name, self._agent.get_agent_metadata(), self._pool.data_ptr(),
                             self._pool.shape[0], self._spec, self._mem_type, self._device_id)

    def add_peer(self, metadata: AgentMetadata | GroupMetadata) -> str:
        """(See ``KvTransfer``.) ``metadata`` may be a parallel worker's (``GroupMetadata``): its
        ranks this agent writes to are added, and the peer's name is its rank 0's."""
        assert self._spec is not None and self.shape is not None, "register_kv_pool first"
        if isinstance(metadata, AgentMetadata):
            metadata = GroupMetadata.single(metadata)
        name = metadata.name
        if self._groups.get(name) == metadata:
            return name
        self.remove_peer(name)
        if metadata.shape.size == 1 and self.shape.size == 1:
            check_convertible(self._spec, metadata.ranks[0].spec)
            wanted = [0]
        else:
            self._check_relayout(metadata)
            wanted = sorted({0, *(p.dst for p in plan_pieces(self.shape, metadata.shape) if p.src == self.rank)})
        for dst in wanted:
            self._add_agent(metadata.ranks[dst])
        self._groups[name] = metadata
        return name

    def _check_relayout(self, target: GroupMetadata) -> None:
        """Between shapes only the split differs: block size, dtype and head size must match."""
        plan_pieces(self.shape, target.shape)  # the same model's layers and heads, or KvLayoutMismatch
        theirs = target.ranks[0].spec
        if (theirs.block_size, theirs.dtype, theirs.head_dim) != (self._spec.block_size, self._spec.dtype,
                                                                  self._spec.head_dim):
            raise KvLayoutMismatch(f"cannot write KV of {self.shape.describe()} {describe_spec(self._spec)} into "
                                   f"{target.shape.describe()} {describe_spec(theirs)}: between parallel shapes "
                                   "block size, dtype and head size must match")

    def _add_agent(self, metadata: AgentMetadata) -> None:
        try:
            name = self._agent.add_remote_agent(metadata.backend_metadata)
            name = name.decode() if isinstance(name, bytes) else name
            blocks = self._agent.prep_xfer_dlist(
                name, _block_descs(metadata.pool_address, metadata.num_blocks, metadata.block_bytes,
                                   metadata.device_id), metadata.mem_type)
        except Exception as exc:  # noqa: BLE001 - nixl raises its own binding errors
            raise KVTransferFailed(f"cannot add peer {metadata.agent_name!r}: {exc}") from exc
        if name != metadata.agent_name:
            raise KVTransferFailed(f"peer metadata names agent {name!r}, published as {metadata.agent_name!r}")
        self._peers[name] = _Peer(name, metadata, blocks)

    def remove_peer(self, peer: str) -> None:
        group = self._groups.pop(peer, None)
        for agent in [r.agent_name for r in group.ranks] if group else [peer]:
            entry = self._peers.pop(agent, None)
            if entry is None:
                continue
            entry.blocks.release()
            try:
                self._agent.remove_remote_agent(agent)
            except Exception as exc:  # noqa: BLE001
                log.warning("removing NIXL peer %s: %s", agent, exc)

    # -- writes -----------------------------------------------------------------------------------
    def write_blocks(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                     notify: bytes) -> TransferHandle:
        group = self._groups.get(peer)
        if group is None:
            raise KVTransferFailed(f"unknown peer {peer!r} (known: {sorted(self._groups)}): add_peer first")
        if group.shape.size > 1 or self.shape.size > 1:
            return self.write_pieces(peer, local_block_ids, remote_block_ids, then_notify=notify)
        entry = self._peers[peer]
        assert self._pool is not None and self._spec is not None
        local_ids, remote_ids = list(local_block_ids), list(remote_block_ids)
        _check_ids("local", local_ids, self._pool.shape[0])
        _check_ids("remote", remote_ids, entry.metadata.num_blocks)
        if len(set(remote_ids)) != len(remote_ids):
            raise KVTransferFailed(f"remote block ids repeat: {remote_ids}")
        try:
            if needs_conversion(self._spec, entry.metadata.spec):
                return self._write_converted(entry, local_ids, remote_ids, notify)
            return self._write_direct(entry, local_ids, remote_ids, notify)
        except KVTransferFailed:
            self.stats.num_failed += 1
            raise
        except Exception as exc:  # noqa: BLE001 - binding errors (nixlBackendError, ...) become ours
            self.stats.num_failed += 1
            raise KVTransferFailed(f"write of {len(local_ids)} blocks to {peer!r} failed to start: {exc}") from exc

    def _write_direct(self, peer: _Peer, local_ids: list[int], remote_ids: list[int],
                      notify: bytes) -> TransferHandle:
        runs = joint_runs(local_ids, remote_ids)
        num_bytes = len(local_ids) * peer.metadata.block_bytes
        handle = TransferHandle(peer.name, num_bytes, len(runs), notify)
        message = _NOTIFY_HEADER.pack(_NOTIFY_MAGIC, num_bytes) + notify
        if not local_ids:  # nothing to move: the notification alone
            self._agent.send_notif(peer.name, message)
            handle.done, handle.backend_descriptors = True, 0
            self._count_done(handle)
            return handle
        handle.backend_handle = self._agent.make_prepped_xfer(
            "WRITE", self._local_blocks, np.asarray(local_ids, dtype=np.int32),
            peer.blocks, np.asarray(remote_ids, dtype=np.int32), message)
        self._post(handle, message)
        return handle

    def _write_converted(self, peer: _Peer, local_ids: list[int], remote_ids: list[int],
                         notify: bytes) -> TransferHandle:
        """Different block size or dtype: gather, convert into a staging slab registered for this
        write (the slow path), then one descriptor per remote contiguous run."""
        assert self._pool is not None and self._spec is not None
        remote = peer.metadata
        staging = convert_slab(gather_kv_blocks(self._pool, local_ids), self._spec, remote.spec, len(remote_ids))
        registration = self._agent.register_memory(staging)
        block_bytes = remote.block_bytes
        local_descs, remote_descs, offset = [], [], 0
        for first, count in contiguous_runs(remote_ids):
            local_descs.append((staging.data_ptr() + offset * block_bytes, count * block_bytes, self._device_id))
            remote_descs.append((remote.pool_address + first * block_bytes, count * block_bytes, remote.device_id))
            offset += count
        num_bytes = len(remote_ids) * block_bytes
        handle = TransferHandle(peer.name, num_bytes, len(local_descs), notify,
                                resources=[staging, registration])
        message = _NOTIFY_HEADER.pack(_NOTIFY_MAGIC, num_bytes) + notify
        try:
            handle.backend_handle = self._agent.initialize_xfer(
                "WRITE", self._agent.get_xfer_descs(local_descs, self._mem_type),
                self._agent.get_xfer_descs(remote_descs, remote.mem_type), peer.name, message)
            self._post(handle, message)
        except Exception:
            self._release(handle)
            raise
        return handle

    def write_pieces(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int], *,
                     then_notify: bytes | None = None,
                     gathered: Gathered | None = None) -> TransferHandle:
        """This rank's pieces (``plan_pieces``) of a write into ``peer``, a worker of another
        parallel shape (or a rank of the same shape), every piece posted before any is waited on:
        each written straight from the pool where it takes every head this rank holds (a range of
        layers of a block is one run there: the same shape, or only the layers split), else
        gathered into a staging slab in the target rank's layout; one descriptor per block, merged
        where consecutive blocks are contiguous on both sides (``region_runs``: whole blocks into
        consecutive ids). ``gathered``: the stage's heads put together for this rank's gathered
        pieces (``Gathered``; straight from there, with no slab, where it lies in registered
        memory and a piece takes every head).
        ``then_notify``: sent to the peer's rank 0 once every piece landed (a parallel worker's
        rank 0 sends it itself, with ``notify``, once every rank is done)."""
        group = self._groups.get(peer)
        if group is None:
            raise KVTransferFailed(f"unknown peer {peer!r} (known: {sorted(self._groups)}): add_peer first")
        assert self._pool is not None and self._spec is not None and self.shape is not None
        local_ids, remote_ids = list(local_block_ids), list(remote_block_ids)
        _check_ids("local", local_ids, self._pool.shape[0])
        _check_ids("remote", remote_ids, group.ranks[0].num_blocks)
        if len(local_ids) != len(remote_ids) or len(set(remote_ids)) != len(remote_ids):
            raise KVTransferFailed(f"{len(local_ids)} local block ids for {len(remote_ids)} remote ones "
                                   f"(remote ids must not repeat)")
        handle = TransferHandle(peer, 0, 0, then_notify or b"", backend_handle=[], then_notify=then_notify)
        try:
            for piece in plan_pieces(self.shape, group.shape):
                if piece.src == self.rank and local_ids:
                    self._write_piece(handle, group, piece, local_ids, remote_ids, gathered)
        except Exception as exc:  # noqa: BLE001 - binding errors become ours; what was posted is dropped
            self._release(handle)
            self.stats.num_failed += 1
            if isinstance(exc, KVTransferFailed):
                raise
            raise KVTransferFailed(f"write of {len(local_ids)} blocks to {peer!r} failed to start: {exc}") from exc
        if not handle.backend_handle:
            self._finish(handle)
        return handle

    def _write_piece(self, handle: TransferHandle, group: GroupMetadata, piece: Piece, local_ids: list[int],
                     remote_ids: list[int], gathered: Gathered | None) -> None:
        """Post one piece: every block's bytes of it from where they lie (``_piece_sources``), one
        descriptor per run of blocks contiguous on both sides (``region_runs``)."""
        assert self._pool is not None
        target = group.ranks[piece.dst]
        layer_bytes = target.block_bytes // target.spec.num_layers
        chunk_bytes = len(piece.layers) * layer_bytes
        offset = (piece.layers.start - group.shape.layers(piece.dst).start) * layer_bytes
        sources = self._piece_sources(handle, piece, local_ids, gathered, chunk_bytes)
        remote = (np.uint64(target.pool_address + offset)
                  + np.asarray(remote_ids, dtype=np.uint64) * np.uint64(target.block_bytes))
        runs = region_runs(sources, remote, chunk_bytes)  # [m, 3]: local, remote, bytes
        local_descs = np.column_stack([runs[:, 0], runs[:, 2], np.full(len(runs), self._device_id, dtype=np.uint64)])
        remote_descs = np.column_stack([runs[:, 1], runs[:, 2], np.full(len(runs), target.device_id, dtype=np.uint64)])
        xfer = self._agent.initialize_xfer(
            "WRITE", self._agent.get_xfer_descs(local_descs, self._mem_type),
            self._agent.get_xfer_descs(remote_descs, target.mem_type), target.agent_name, b"")
        handle.backend_handle.append(xfer)
        handle.num_descriptors += len(runs)
        handle.num_bytes += len(local_ids) * chunk_bytes
        if self._agent.transfer(xfer) == "ERR":
            raise KVTransferFailed(f"NIXL refused to post a write of {len(local_ids) * chunk_bytes} B to "
                                   f"{target.agent_name!r}")

    def _piece_sources(self, handle: TransferHandle, piece: Piece, local_ids: list[int], gathered: Gathered | None,
                       chunk_bytes: int) -> np.ndarray:
        """Where each block's bytes of ``piece`` lie in this process, laid out as the target rank's
        block holds them (``[its layers, 2, bs, its heads, D]``, one run of ``chunk_bytes``): an
        address per block, in order. In the pool itself where the piece takes every head this rank
        holds (a range of layers of a pool block is one run); in the stage's gathered heads where
        those lie in registered memory and the piece takes every head; else copied into a slab."""
        assert self._pool is not None and self._spec is not None and self.shape is not None
        mine_layers, mine_heads = self.shape.layers(self.rank), self.shape.heads(self.rank)
        block_bytes, n = self._spec.bytes_per_block, len(local_ids)
        if not piece.gathered and piece.heads == mine_heads:  # no staging: written from the pool
            first = (piece.layers.start - mine_layers.start) * (block_bytes // self._spec.num_layers)
            return (np.uint64(self._pool.data_ptr() + first)
                    + np.asarray(local_ids, dtype=np.uint64) * np.uint64(block_bytes))
        if piece.gathered:
            if gathered is None:
                raise KVTransferFailed(f"rank {self.rank}: a gathered piece without the stage's gathered heads")
            source, first_layer, first_head, ids = gathered.blocks, gathered.first_layer, 0, slice(None)
        else:  # slice the pool before taking the blocks: only the piece's bytes are copied
            source, first_layer, first_head, ids = self._pool, mine_layers.start, mine_heads.start, local_ids
        layers = slice(piece.layers.start - first_layer, piece.layers.stop - first_layer)
        heads = slice(piece.heads.start - first_head, piece.heads.stop - first_head)
        view = source[:, layers, :, :, heads]  # strided: the piece's layers and heads of every block
        stride = chunk_bytes
        if piece.gathered and gathered.registered and heads == slice(0, source.shape[4]):
            # in registered memory already, every block's piece one contiguous run: written from there
            staging, stride = view, source.stride(0) * source.element_size()
        else:
            slab = self._take_slab(n * chunk_bytes)
            handle.resources.append(slab)
            staging = slab.buffer[:n * chunk_bytes].view(view.dtype).view(n, *view.shape[1:])
            if piece.gathered:  # [n, its layers, 2, bs, their heads, D], one copy into registered memory
                staging.copy_(view)
            else:
                torch.index_select(view, 0, torch.tensor(ids, dtype=torch.long, device=view.device), out=staging)
        return np.uint64(staging.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(stride)

    def notify(self, peer: str, num_bytes: int, notify: bytes) -> None:
        """Send ``notify`` to ``peer``'s rank 0, counting ``num_bytes`` as written into it (a
        parallel worker's rank 0, once every rank's pieces landed)."""
        group = self._groups.get(peer)
        if group is None:
            raise KVTransferFailed(f"unknown peer {peer!r}: add_peer first")
        try:
            self._agent.send_notif(group.name, _NOTIFY_HEADER.pack(_NOTIFY_MAGIC, num_bytes) + notify)
        except Exception as exc:  # noqa: BLE001
            raise KVTransferFailed(f"cannot notify {peer!r}: {exc}") from exc

    def _post(self, handle: TransferHandle, message: bytes) -> None:
        state = self._agent.transfer(handle.backend_handle, message)
        if state == "ERR":
            self._release(handle)
            raise KVTransferFailed(f"NIXL refused to post a write of {handle.num_bytes} B to {handle.peer!r}")

    # -- completion -------------------------------------------------------------------------------
    def poll(self, handle: TransferHandle) -> bool:
        if handle.done:
            return True
        if isinstance(handle.backend_handle, list):  # pieces (write_pieces)
            states = [self._agent.check_xfer_state(x) for x in handle.backend_handle]
            if "PROC" in states and "ERR" not in states:
                return False
            self._release(handle)
            if "ERR" in states:
                self.stats.num_failed += 1
                raise KVTransferFailed(f"write of {handle.num_bytes} B to {handle.peer!r} failed")
            self._finish(handle)
            return True
        state = self._agent.check_xfer_state(handle.backend_handle)
        if state == "PROC":
            return False
        if self._capture_telemetry and state == "DONE":
            handle.backend_descriptors = self._agent.get_xfer_telemetry(handle.backend_handle).descCount
        self._release(handle)
        if state == "ERR":
            self.stats.num_failed += 1
            raise KVTransferFailed(f"write of {handle.num_bytes} B to {handle.peer!r} failed")
        handle.done = True
        self._count_done(handle)
        return True

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        # spin briefly (small writes finish in microseconds), then back off to spare the cores
        sleep_until_written(self, handle, timeout_s, first_pause_s=1e-5)

    def cancel(self, handle: TransferHandle) -> None:
        if handle.done:
            return
        self._release(handle)
        self.stats.num_failed += 1

    def _finish(self, handle: TransferHandle) -> None:
        if handle.then_notify is not None:
            self.notify(handle.peer, handle.num_bytes, handle.then_notify)
        handle.done = True
        self._count_done(handle)

    def _count_done(self, handle: TransferHandle) -> None:
        self.stats.num_transfers += 1
        self.stats.num_bytes_sent += handle.num_bytes
        self.stats.num_descriptors += handle.num_descriptors

    def _release(self, handle: TransferHandle) -> None:
        xfers = handle.backend_handle if isinstance(handle.backend_handle, list) else [handle.backend_handle]
        for xfer in xfers:
            if xfer is None:
                continue
            try:
                xfer.release()
            except Exception as exc:  # noqa: BLE001 - an uncancellable write: nixl keeps it for later
                log.warning("releasing a NIXL write to %s: %s", handle.peer, exc)
        handle.backend_handle = None
        for resource in handle.resources:
            if isinstance(resource, _Slab):
                self._give_back(resource)
            elif not isinstance(resource, torch.Tensor):  # a registration of a staging slab
                self._agent.deregister_memory(resource)
        handle.resources.clear()

    def _take_slab(self, num_bytes: int) -> _Slab:
        """Registered staging of at least ``num_bytes``: the smallest free one that fits, else a new
        one (rounded up to a MiB). Registering and first touching a fresh buffer for every write
        cost more than the copy into it."""
        fits = [s for s in self._free_slabs if s.buffer.numel() >= num_bytes]
        if fits:
            slab = min(fits, key=lambda s: s.buffer.numel())
            self._free_slabs.remove(slab)
            return slab
        assert self._pool is not None
        buffer = torch.empty(-(-num_bytes // (1 << 20)) << 20, dtype=torch.uint8, device=self._pool.device)
        return _Slab(buffer, self._agent.register_memory(buffer))

    def register(self, buffer: torch.Tensor) -> object:
        """Register ``buffer`` (memory this rank shares with its stage: ``SharedStaging``) so that
        writes can start from it; ``deregister`` with what this returns."""
        return self._agent.register_memory(buffer)

    def deregister(self, registration: object) -> None:
        self._agent.deregister_memory(registration)

    def _give_back(self, slab: _Slab) -> None:
        self._free_slabs.append(slab)
        while sum(s.buffer.numel() for s in self._free_slabs) > _MAX_FREE_SLAB_BYTES:
            oldest = self._free_slabs.pop(0)
            self._agent.deregister_memory(oldest.registration)

    def get_notifications(self) -> list[TransferNotification]:
        out = []
        for peer, messages in self._agent.get_new_notifs().items():
            peer = peer.decode() if isinstance(peer, bytes) else peer
            for raw in messages:
                num_bytes, message = 0, raw
                if raw[:4] == _NOTIFY_MAGIC and len(raw) >= _NOTIFY_HEADER.size:
                    num_bytes = _NOTIFY_HEADER.unpack_from(raw)[1]
                    message = raw[_NOTIFY_HEADER.size:]
                self.stats.num_bytes_received += num_bytes
                out.append(TransferNotification(peer, message, num_bytes))
        return out

    def close(self) -> None:
        for peer in list(self._groups):
            self.remove_peer(peer)
        for slab in self._free_slabs:
            self._agent.deregister_memory(slab.registration)
        self._free_slabs.clear()
        if self._local_blocks is not None:
            self._local_blocks.release()
            self._local_blocks = None
        if self._registration is not None:
            self._agent.deregister_memory(self._registration)
            self._registration = None


def _check_ids(side: str, block_ids: list[int], num_blocks: int) -> None:
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise KVTransferFailed(f"{side} block ids {bad[:8]} out of range [0, {num_blocks})")
