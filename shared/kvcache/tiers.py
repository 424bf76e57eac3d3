"""Tiers below the KV pool: host memory, then local disk (G2 and G3 under the device pool's G1).

A cached block evicted from the pool is copied out first (``offload``, called by the pool while
the block still holds its content): into the host tier, and, once its hash has been used at least
``disk_min_uses`` times, into the disk tier by a writer thread, so the step never waits on a disk.
A prompt whose next blocks sit in a lower tier gets them back before it is scheduled: host blocks
are copied into fresh pool blocks when the scheduler walks the prompt (``lookup`` / ``load``);
disk blocks are read into the host tier by a reader thread as soon as the request arrives
(``prefetch``), and only that request waits for them (``is_loading``).

Blocks keep their chained hashes. A disk file carries its block's hash, parent hash, tokens and a
CRC-32 of the KV bytes, and lives in a directory named after everything that shapes the KV (model
namespace, precision, layer/head geometry), so a file is used only if it is whole, its checksum
matches and its tokens hash to its name; anything else is a miss (the file is dropped) and the
prompt is recomputed, never answered from wrong KV. The disk tier outlives the process: a worker
started on the same directory rebuilds its index from the files and announces them as KV events.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.kvcache.block_pool import Block
from shared.kvcache.events import BlockRemoved, BlockStored, KvEventEmitter
from shared.kvcache.hashing import ROOT_PARENT, hash_block
from shared.kvcache.layout import KvCacheSpec

log = logging.getLogger(__name__)

_MAGIC = b"TKVB1\n"
_PREFIX = len(_MAGIC) + 4  # magic, then the header's length
_SUFFIX = ".kvb"
_MAX_USE_COUNTS = 1 << 20  # hashes whose use counts are remembered (oldest forgotten first)


@dataclass(frozen=True)
class TierConfig:
    host_bytes: int = 0  # host-memory tier budget; 0: off
    disk_dir: str | None = None  # disk tier directory; None: off
    disk_bytes: int = 10 << 30  # disk tier budget
    disk_min_uses: int = 2  # a block goes to disk once its hash was computed or hit this many times

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_dir is not None


@dataclass
class StoredBlock:
    """A block's KV outside the pool: ``data`` is ``[num_layers, 2, block_size, heads, head_dim]``
    on the host."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    data: torch.Tensor
    from_disk: bool = False


@dataclass
class TierCounters:
    offloaded_host: int = 0  # blocks copied from the pool into the host tier
    offloaded_disk: int = 0  # blocks written to disk
    onboarded: int = 0  # blocks copied back into the pool (they pass through host memory)
    onboarded_disk: int = 0  # of those, blocks that had been read from disk
    disk_read_failures: int = 0  # corrupt, truncated or mismatched files (treated as misses)
    offload_seconds: float = 0.0  # engine-thread time spent copying evicted blocks out

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


class HostTier:
    """Blocks in host memory, least recently used evicted first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, StoredBlock] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, block_hash: int) -> StoredBlock | None:
        with self._lock:
            stored = self._blocks.get(block_hash)
            if stored is not None:
                self._blocks.move_to_end(block_hash)
            return stored

    def put(self, stored: StoredBlock) -> list[int]:
        """Add (or refresh) a block; returns the hashes evicted to make room."""
        with self._lock:
            self._blocks[stored.block_hash] = stored
            self._blocks.move_to_end(stored.block_hash)
            evicted = []
            while len(self._blocks) > self.capacity_blocks:
                evicted.append(self._blocks.popitem(last=False)[0])
            return evicted


class DiskTier:
    """One file per block under ``root``, least recently used deleted first. Thread-safe."""

    def __init__(self, root: Path, capacity_blocks: int, spec: KvCacheSpec, namespace: bytes) -> None:
        self.root = root
        self.capacity_blocks = capacity_blocks
        self.spec = spec
        self.namespace = namespace
        self._shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self._nbytes = spec.bytes_per_block
        self._index: OrderedDict[int, tuple[int | None, tuple[int, ...]]] = OrderedDict()  # hash -> (parent, tokens)
        self._lock = threading.Lock()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"KV disk tier: cannot use {root.parent}: {exc.strerror or exc}") from None

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def _path(self, block_hash: int) -> Path:
        return self.root / f"{block_hash:016x}{_SUFFIX}"

    def entries(self) -> list[tuple[int, int | None, tuple[int, ...]]]:
        with self._lock:
            return [(h, p, t) for h, (p, t) in self._index.items()]

    def scan(self) -> int:
        """Index the files already in ``root`` (oldest first); unreadable ones are deleted."""
        files = sorted(self.root.glob(f"*{_SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            header = self._read_header(path)
            if header is None or f"{header['hash']:016x}{_SUFFIX}" != path.name:
                log.warning("KV disk tier: dropping unreadable block file %s", path.name)
                path.unlink(missing_ok=True)
                continue
            self._index[header["hash"]] = (header["parent"], tuple(header["tokens"]))
        for path in self.root.glob(f"*{_SUFFIX}.tmp"):  # a write cut short by a crash
            path.unlink(missing_ok=True)
        return len(self._index)

    def write(self, stored: StoredBlock) -> list[int]:
        """Write one block (atomically: temp file, then rename); returns the hashes evicted."""
        payload = stored.data.contiguous().view(torch.uint8).numpy().tobytes()
        header = json.dumps({"hash": stored.block_hash, "parent": stored.parent_hash,
                             "tokens": list(stored.token_ids), "nbytes": len(payload),
                             "crc32": zlib.crc32(payload)}).encode()
        path = self._path(stored.block_hash)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_MAGIC + struct.pack("<I", len(header)) + header)
            f.write(payload)
        os.replace(tmp, path)
        with self._lock:
            self._index[stored.block_hash] = (stored.parent_hash, stored.token_ids)
            self._index.move_to_end(stored.block_hash)
            evicted = []
            while len(self._index) > self.capacity_blocks:
                evicted.append(self._index.popitem(last=False)[0])
        for block_hash in evicted:
            self._path(block_hash).unlink(missing_ok=True)
        return evicted

    def read(self, block_hash: int) -> StoredBlock | None:
        """The block, or None (and the file dropped) if it is missing, truncated, corrupt or not
        the block its name says."""
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:  # one copy: the file into the buffer the tensor will use
                raw = bytearray(os.fstat(f.fileno()).st_size)
                if f.readinto(raw) != len(raw):
                    raise ValueError("short read")
            header, start = self._parse(raw)
            payload = memoryview(raw)[start:]
            if header["hash"] != block_hash:
                raise ValueError(f"holds block {header['hash']:016x}")
            if len(payload) != self._nbytes or header["nbytes"] != self._nbytes:
                raise ValueError(f"{len(payload)} bytes of KV where {self._nbytes} are due")
            if zlib.crc32(payload) != header["crc32"]:
                raise ValueError("checksum mismatch")
            tokens = tuple(header["tokens"])
            parent = header["parent"]
            if len(tokens) != self.spec.block_size or hash_block(
                    ROOT_PARENT if parent is None else parent, tokens, self.namespace) != block_hash:
                raise ValueError("its tokens do not hash to its name")
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            log.warning("KV disk tier: block %016x is unusable (%s): recomputing it", block_hash, exc)
            self.remove(block_hash)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        data = torch.frombuffer(raw, dtype=torch.uint8, offset=start, count=self._nbytes)
        return StoredBlock(block_hash, parent, tokens, data.view(self.spec.dtype).reshape(self._shape))

    def remove(self, block_hash: int) -> None:
        with self._lock:
            self._index.pop(block_hash, None)
        self._path(block_hash).unlink(missing_ok=True)

    def _read_header(self, path: Path) -> dict | None:
        """A file's header without its KV bytes, or None if the file is not a whole block file."""
        try:
            with open(path, "rb") as f:
                length = _header_length(f.read(_PREFIX))
                header = json.loads(f.read(length))
            if path.stat().st_size != _PREFIX + length + self._nbytes:
                return None
            return header
        except (OSError, ValueError):
            return None

    @staticmethod
    def _parse(raw: bytearray) -> tuple[dict, int]:
        """The header, and where the KV bytes start."""
        length = _header_length(raw)
        return json.loads(bytes(raw[_PREFIX:_PREFIX + length])), _PREFIX + length


def _header_length(prefix: bytes | bytearray) -> int:
    """The header's length, from a file's first bytes (magic, then a little-endian u32)."""
    if len(prefix) < _PREFIX or not prefix.startswith(_MAGIC):
        raise ValueError("not a KV block file")
    return struct.unpack_from("<I", prefix, len(_MAGIC))[0]


def tier_directory(base: str | os.PathLike, spec: KvCacheSpec, namespace: bytes, precision: str) -> Path:
    """Where one model/precision/geometry keeps its blocks under ``base``: KV written by another
    configuration is never read back."""
    what = json.dumps([namespace.hex(), precision, spec.num_layers, spec.num_kv_heads, spec.head_dim,
                       spec.block_size, str(spec.dtype)]).encode()
    return Path(base) / hashlib.blake2b(what, digest_size=8).hexdigest()


class PoolBlocks:
    """Whole blocks of one process's pool, as a tier copies them out and back. A parallel worker's
    pool is sharded over its ranks: ``shared.engine.parallel.GroupBlocks`` reads and writes whole
    blocks across them instead, with the same two methods."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def read(self, block_ids: Sequence[int]) -> torch.Tensor:  # [n, L, 2, bs, Hkv, D] on the CPU
        return self.kv_cache.index_select(0, torch.tensor(list(block_ids), device=self.kv_cache.device)).to("cpu")

    def write(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        dev = self.kv_cache.device
        self.kv_cache.index_copy_(0, torch.tensor(list(block_ids), device=dev), data.to(dev))


class KvTiers:
    """The host and disk tiers of one engine, and the threads that move blocks to and from disk.

    Engine-thread methods: ``offload`` (the pool's eviction hook), ``lookup``, ``load``,
    ``prefetch``, ``is_loading``, ``note_use``. Disk work runs on one writer and one reader thread.
    """

    def __init__(self, config: TierConfig, spec: KvCacheSpec, kv_cache: torch.Tensor, namespace: bytes,
                 events: KvEventEmitter, *, precision: str = "", max_blocks_per_request: int = 0,
                 blocks: PoolBlocks | None = None) -> None:
        """``spec``: the whole blocks the tiers keep; ``blocks``: how they are read from and written
        to the pool (default: ``kv_cache`` itself, whose blocks are whole)."""
        self.config = config
        self.spec = spec
        self.blocks = blocks if blocks is not None else PoolBlocks(kv_cache)
        self.events = events
        self.counters = TierCounters()
        self.host = HostTier(config.host_bytes // spec.bytes_per_block) if config.host_bytes > 0 else None
        # with no host tier, blocks read from disk wait here until their request is scheduled
        self._staging = self.host if self.host is not None else HostTier(max(64, max_blocks_per_request))
        self.disk: DiskTier | None = None
        self._uses: OrderedDict[int, int] = OrderedDict()
        self._loading: dict[int, concurrent.futures.Future] = {}
        self._writes: queue.Queue[StoredBlock | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        if config.disk_dir is not None:
            root = tier_directory(config.disk_dir, spec, namespace, precision)
            self.disk = DiskTier(root, max(1, config.disk_bytes // spec.bytes_per_block), spec, namespace)
            found = self.disk.scan()
            log.info("KV disk tier at %s: %d blocks found (budget %d blocks)", root, found,
                     self.disk.capacity_blocks)
            self._writer = threading.Thread(target=self._write_forever, name="tandem-kv-disk-writer",
                                            daemon=True)
            self._writer.start()
            self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tandem-kv-disk-reader")
        if self.host is not None:
            log.info("KV host tier: %d blocks (%.0f MiB)", self.host.capacity_blocks,
                     self.host.capacity_blocks * spec.bytes_per_block / 2**20)

    # -- the pool's eviction hook ---------------------------------------------------------------
    def offload(self, blocks: list[Block]) -> None:
        """Copy evicted cached blocks out of the pool before their content is overwritten."""
        started = time.perf_counter()
        stored_blocks = self._copy_out(blocks)
        to_host = stored_blocks if self.host is not None else []
        if to_host:
            dropped = []
            for stored in to_host:
                dropped.extend(self.host.put(stored))
            self.counters.offloaded_host += len(to_host)
            self._announce("host", to_host)
            if dropped:
                self.events.emit(BlockRemoved(tuple(dropped), tier="host"))
        for stored in stored_blocks:
            if self._wants_disk(stored.block_hash):
                self._writes.put(stored)
        self.counters.offload_seconds += time.perf_counter() - started

    def persist(self, blocks: list[Block]) -> int:
        """Queue the pool's cached blocks that pass the frequency filter for the disk (on a clean
        shutdown, so a restarted worker finds them); returns how many were queued."""
        chosen = [b for b in blocks if self._wants_disk(b.block_hash)]
        if chosen:
            for stored in self._copy_out(chosen):
                self._writes.put(stored)
        return len(chosen)

    def _copy_out(self, blocks: list[Block]) -> list[StoredBlock]:
        """The blocks' KV on the host: one gather, one copy."""
        data = self.blocks.read([b.block_id for b in blocks])
        return [StoredBlock(b.block_hash, b.parent_hash, b.token_ids, data[i]) for i, b in enumerate(blocks)]

    def _wants_disk(self, block_hash: int) -> bool:
        """A disk tier exists, lacks the block and the block passed the frequency filter."""
        return (self.disk is not None and block_hash not in self.disk
                and self._uses.get(block_hash, 0) >= self.config.disk_min_uses)

    # -- onboarding -------------------------------------------------------------------------------
    def lookup(self, block_hash: int) -> StoredBlock | None:
        """The block if it is in host memory now (from the host tier or read from disk)."""
        return self._staging.get(block_hash)

    def load(self, block_ids: Sequence[int], stored: Sequence[StoredBlock]) -> None:
        """Copy blocks into the pool's ``block_ids``."""
        self.blocks.write(block_ids, torch.stack([s.data for s in stored]))
        self.counters.onboarded += len(stored)
        self.counters.onboarded_disk += sum(1 for s in stored if s.from_disk)

    def prefetch(self, block_hashes: Sequence[int], is_cached: Callable[[int], bool]) -> None:
        """Start reading from disk the run of ``block_hashes`` (after those ``is_cached`` in the
        pool or in host memory) that the disk tier holds."""
        if self.disk is None:
            return
        run = []
        for block_hash in block_hashes:
            if self._staging.get(block_hash) is not None:  # refreshed: reading the rest must not evict it
                if run:
                    break
                continue
            if is_cached(block_hash) or block_hash in self._loading:
                if run:
                    break
                continue
            if block_hash not in self.disk:
                break
            run.append(block_hash)
        if not run:
            return
        future = self._reader.submit(self._read_run, run)
        for block_hash in run:
            self._loading[block_hash] = future

    def is_loading(self, block_hashes: Iterable[int]) -> bool:
        """Whether a disk read for any of these blocks is still under way."""
        if not self._loading:
            return False
        for block_hash in block_hashes:
            future = self._loading.get(block_hash)
            if future is not None:
                if not future.done():
                    return True
                del self._loading[block_hash]
        return False

    def wait_loading(self, timeout_s: float) -> None:
        """Block the engine thread until some disk read finishes (when it has nothing else to do)."""
        pending = [f for f in self._loading.values() if not f.done()]
        if pending:
            concurrent.futures.wait(pending, timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)
        for block_hash in [h for h, f in self._loading.items() if f.done()]:
            del self._loading[block_hash]

    def note_use(self, block_hashes: Iterable[int]) -> None:
        """Count a computation or a hit of each block (the disk tier's frequency filter)."""
        if self.disk is None:
            return
        for block_hash in block_hashes:
            self._uses[block_hash] = self._uses.pop(block_hash, 0) + 1
        while len(self._uses) > _MAX_USE_COUNTS:
            self._uses.popitem(last=False)

    # -- events, stats, shutdown ------------------------------------------------------------------
    def announce_disk(self) -> None:
        """Tell the index what the disk tier holds (on start, once a sink listens)."""
        if self.disk is None:
            return
        for block_hash, parent, tokens in self.disk.entries():
            self.events.emit(BlockStored((block_hash,), parent, tokens, self.spec.block_size, tier="disk"))

    def stats(self) -> dict[str, float]:
        return {"host_blocks": len(self.host) if self.host is not None else 0,
                "host_capacity_blocks": self.host.capacity_blocks if self.host is not None else 0,
                "disk_blocks": len(self.disk) if self.disk is not None else 0,
                "disk_capacity_blocks": self.disk.capacity_blocks if self.disk is not None else 0,
                **self.counters.as_dict()}

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued disk write is done."""
        deadline = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._writes.unfinished_tasks

    def close(self) -> None:
        if self._writer is not None:
            self.flush()
            self._writes.put(None)
            self._writer.join(5)
        if self._reader is not None:
            self._reader.shutdown(wait=True)

    # -- threads ----------------------------------------------------------------------------------
    def _announce(self, tier: str, stored: list[StoredBlock]) -> None:
        for s in stored:
            self.events.emit(BlockStored((s.block_hash,), s.parent_hash, s.token_ids, self.spec.block_size,
                                         tier=tier))

    def _write_forever(self) -> None:
        while True:
            stored = self._writes.get()
            try:
                if stored is None:
                    return
                if stored.block_hash in self.disk:
                    continue
                evicted = self.disk.write(stored)
                self.counters.offloaded_disk += 1
                self._announce("disk", [stored])
                if evicted:
                    self.events.emit(BlockRemoved(tuple(evicted), tier="disk"))
            except Exception:  # noqa: BLE001 — a failed write is a lost copy, never a lost request
                log.exception("KV disk tier: writing block %016x failed", stored.block_hash)
            finally:
                self._writes.task_done()

    def _read_run(self, run: list[int]) -> None:
        for block_hash in run:
            stored = self.disk.read(block_hash)
            if stored is None:
                self.counters.disk_read_failures += 1
                self.events.emit(BlockRemoved((block_hash,), tier="disk"))
                return  # the chain is broken here: later blocks cannot be used
            stored.from_disk = True
            dropped = self._staging.put(stored)
            if dropped and self._staging is self.host:
                self.events.emit(BlockRemoved(tuple(dropped), tier="host"))
