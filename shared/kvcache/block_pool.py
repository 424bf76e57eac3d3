"""The block pool: ref-counted KV blocks, a prefix cache keyed by block hash, LRU eviction.

Pure Python: no torch. Block ids index the KV tensor's first dimension.

Free blocks live in one queue in eviction order (front = evicted first). A freed block that holds
cached content goes to the back, so it stays reusable until everything older is gone; a freed block
without content goes to the front, since keeping it buys nothing. A request frees its blocks tail
first, so among its cached blocks the tail is evicted before the shared head.

Evicting a cached block calls ``on_evict`` first, with the blocks still holding their content and
hashes: the tiers below the pool (shared/kvcache/tiers.py) copy them out there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from shared.kvcache.events import BlockRemoved, BlockStored, KvEventEmitter


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    # while cached: the parent block's hash and this block's tokens (what a lower tier stores)
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_caching: bool = True,
                 events: KvEventEmitter | None = None,
                 on_evict: Callable[[list[Block]], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events or KvEventEmitter()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, Block] = {}
        self.on_evict = on_evict

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: int) -> Block | None:
        return self._cached.get(block_hash)

    def cached_blocks(self) -> list[Block]:
        """Every block holding cached content (in use or not)."""
        return list(self._cached.values())

    def eviction_order(self) -> list[int]:
        """Free block ids, the next to be evicted first."""
        return list(self._free)

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[Block]:
        """Take ``num_blocks`` blocks from the front of the free queue, evicting their cached content.
        The caller checks ``num_free_blocks`` first."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks with {len(self._free)} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            block.ref_count = 1
            taken.append(block)
        evicted = [b for b in taken if b.block_hash is not None]
        if evicted:
            if self.on_evict is not None:
                self.on_evict(evicted)
            removed = tuple(b.block_hash for b in evicted)
            for block in evicted:
                del self._cached[block.block_hash]
                block.block_hash, block.parent_hash, block.token_ids = None, None, ()
            self.events.emit(BlockRemoved(removed))
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits (possibly sitting in the free queue)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference on each block, given in the order they should be evicted."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref_count {block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    # -- caching ------------------------------------------------------------------------------
    def cache_blocks(
        self, blocks: Sequence[Block], block_hashes: Sequence[int], parent_hash: int | None,
        token_ids: Sequence[int], block_size: int,
    ) -> None:
        """Mark full, computed blocks as cached under their hashes and emit one BlockStored.

        A hash already cached by another block (two requests computed the same prefix at once)
        leaves this block uncached; the chain stays valid because the hash names the content.
        """
        if not self.enable_caching:
            return
        stored: list[int] = []
        parent = parent_hash
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            block_parent, parent = parent, block_hash
            if block.block_hash is not None:
                assert block.block_hash == block_hash, "a cached block's content changed"
                continue
            if block_hash in self._cached:
                continue
            block.block_hash = block_hash
            block.parent_hash = block_parent
            block.token_ids = tuple(token_ids[i * block_size:(i + 1) * block_size])
            self._cached[block_hash] = block
            stored.append(block_hash)
        if stored:
            # BlockStored carries the whole run so the index can rebuild the chain; consumers
            # treat already-known hashes as no-ops.
            self.events.emit(BlockStored(tuple(block_hashes), parent_hash, tuple(token_ids), block_size))

    def check_integrity(self) -> None:
        """Raise with the arithmetic if the pool's books do not balance."""
        in_use = sum(1 for b in self.blocks if b.ref_count > 0)
        if in_use + len(self._free) != self.num_blocks:
            raise RuntimeError(f"{in_use} in use + {len(self._free)} free != {self.num_blocks} blocks")
        for block in self._free.values():
            if block.ref_count != 0:
                raise RuntimeError(f"free block {block.block_id} has ref_count {block.ref_count}")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"cache maps {block_hash} to block {block.block_id} holding {block.block_hash}")
