"""KvTransfer over NIXL (UCX backend): DRAM pools on CPU, VRAM pools on CUDA.

Descriptors are prepared once: the local pool as one descriptor per block when the pool is
registered, each peer's pool likewise when the peer is added. A write selects blocks by index and
NIXL merges entries that are consecutive on both sides, so it moves one descriptor per joint run
(``joint_runs``), which the tests check against NIXL's own telemetry.

Notifications carry a small header with the number of bytes the write moved, so the target can
count received bytes (a one-sided write is otherwise invisible to it).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.dispatch import gather_kv_blocks
from shared.kvcache.layout import KvCacheSpec, contiguous_runs
from shared.transfer.base import (AgentMetadata, KVTransferFailed, TransferHandle, TransferNotification,
                                  TransferStats, TransferUnavailable, joint_runs)
from shared.transfer.convert import check_convertible, convert_slab, needs_conversion
from shared.transfer.write import pauses_until_written

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


@dataclass
class _Peer:
    name: str
    metadata: AgentMetadata
    blocks: object  # prepped dlist handle: one descriptor per block of the peer's pool


class NixlTransfer:
    """See ``KvTransfer``. One NIXL agent per process (per worker)."""

    def __init__(self, agent_name: str, *, backends: Sequence[str] = ("UCX",), progress_thread: bool = False,
                 capture_telemetry: bool = False, backend_params: dict[str, str] | None = None) -> None:
        """``progress_thread``: NIXL's own progress thread polls without pause and keeps a core busy
        even when idle (measured: 3 idle agents took 0.7 of a core here), which a 2-core CPU host
        cannot spare. Without it, ``poll``/``wait`` and ``get_notifications`` drive progress, which
        is all a one-sided write needs. Turn it on where cores are plentiful (GPU servers).

        ``backend_params``: init parameters for every backend, e.g. UCX's
        ``{"ucx_error_handling_mode": "none"}``. NIXL's default ("peer") detects a dead peer; no
        shared-memory transport supports that, so on one host UCX sends its active messages
        (connection setup, notifications) over TCP loopback while the DRAM writes themselves go
        through CMA. "none" allows shared memory for both but loses the detection; on this project's
        2-core host both move KV at the same speed (loadtest/bench/kv_transfer.py --error-modes)."""
        api = load_nixl()
        try:
            config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[],
                                           capture_telemetry=capture_telemetry)
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
        self._peers: dict[str, _Peer] = {}
        self._pool: torch.Tensor | None = None
        self._spec: KvCacheSpec | None = None
        self._registration = None
        self._local_blocks = None

    # -- setup ------------------------------------------------------------------------------------
    def register_kv_pool(self, kv_cache: torch.Tensor, spec: KvCacheSpec) -> None:
        if self._pool is not None:
            raise RuntimeError(f"agent {self.agent_name} already has a registered KV pool")
        expected = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        if not kv_cache.is_contiguous() or tuple(kv_cache.shape[1:]) != expected or kv_cache.dtype != spec.dtype:
            raise ValueError(f"KV pool {tuple(kv_cache.shape)} {kv_cache.dtype} is not a contiguous "
                             f"[blocks, *{expected}] {spec.dtype} tensor")
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

    def add_peer(self, metadata: AgentMetadata) -> str:
        assert self._spec is not None, "register_kv_pool first"
        known = self._peers.get(metadata.agent_name)
        if known is not None and known.metadata == metadata:
            return known.name
        if known is not None:
            self.remove_peer(known.name)
        check_convertible(self._spec, metadata.spec)
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
        return name

    def remove_peer(self, peer: str) -> None:
        entry = self._peers.pop(peer, None)
        if entry is None:
            return
        entry.blocks.release()
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as exc:  # noqa: BLE001
            log.warning("removing NIXL peer %s: %s", peer, exc)

    # -- writes -----------------------------------------------------------------------------------
    def write_blocks(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                     notify: bytes) -> TransferHandle:
        entry = self._peers.get(peer)
        if entry is None:
            raise KVTransferFailed(f"unknown peer {peer!r} (known: {sorted(self._peers)}): add_peer first")
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

    def _post(self, handle: TransferHandle, message: bytes) -> None:
        state = self._agent.transfer(handle.backend_handle, message)
        if state == "ERR":
            self._release(handle)
            raise KVTransferFailed(f"NIXL refused to post a write of {handle.num_bytes} B to {handle.peer!r}")

    # -- completion -------------------------------------------------------------------------------
    def poll(self, handle: TransferHandle) -> bool:
        if handle.done:
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
        for pause in pauses_until_written(self, handle, timeout_s, first_pause_s=1e-5):
            if pause:
                time.sleep(pause)

    def cancel(self, handle: TransferHandle) -> None:
        if handle.done:
            return
        self._release(handle)
        self.stats.num_failed += 1

    def _count_done(self, handle: TransferHandle) -> None:
        self.stats.num_transfers += 1
        self.stats.num_bytes_sent += handle.num_bytes
        self.stats.num_descriptors += handle.num_descriptors

    def _release(self, handle: TransferHandle) -> None:
        if handle.backend_handle is not None:
            try:
                handle.backend_handle.release()
            except Exception as exc:  # noqa: BLE001 - an uncancellable write: nixl keeps it for later
                log.warning("releasing a NIXL write to %s: %s", handle.peer, exc)
            handle.backend_handle = None
        for resource in handle.resources:
            if not isinstance(resource, torch.Tensor):  # a registration of a staging slab
                self._agent.deregister_memory(resource)
        handle.resources.clear()

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
        for peer in list(self._peers):
            self.remove_peer(peer)
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
