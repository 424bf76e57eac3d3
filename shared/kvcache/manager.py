"""Per-request KV block bookkeeping on top of the block pool (vLLM v1's KVCacheManager, slimmed).

Pure Python. A request is known by its id; callers pass its token ids and block hashes.
``allocate_slots`` returns None when the pool cannot serve the request now, never raises for that.
With ``tiers`` (shared/kvcache/tiers.py, passed in by the engine) evicted blocks are copied to host/disk
and a prefix found there is copied back into fresh pool blocks while the prompt is matched.

With ``window`` (a model whose every layer sees only the last ``window`` positions: Mistral, Phi-3),
``free_out_of_window`` gives back the leading blocks no later position of a request can see. They
keep their place in the request's block table (a step's attention masks them, whatever they hold
by then) and their cached content, until the pool evicts it as it evicts any free block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared.kvcache.block_pool import Block, BlockPool
from shared.kvcache.events import KvEventEmitter

if TYPE_CHECKING:
    from shared.kvcache.tiers import KvTiers


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 events: KvEventEmitter | None = None, tiers: KvTiers | None = None,
                 window: int | None = None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must be positive, not {window}")
        self.block_size = block_size
        self.window = window
        self.tiers = tiers  # the pool's evicted blocks go down to them, and come back up from them
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching, events=events,
                              on_evict=tiers.offload if tiers is not None else None)
        self._blocks: dict[str, list[Block]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of the request already cached
        self._num_dropped: dict[str, int] = {}  # leading blocks given back as out of the window

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, block_hashes: Sequence[int], num_tokens: int) -> tuple[list[Block], int]:
        """Longest run of leading cached blocks, and the tokens it covers.

        At least one token is always left to compute (its logits give the next token), so a fully
        cached prompt reuses all but its last block.
        """
        if not self.pool.enable_caching:
            return [], 0
        max_blocks = (num_tokens - 1) // self.block_size
        hits = self._device_hits(block_hashes[:max_blocks])
        if self.tiers is not None and len(hits) < max_blocks and self._onboard(
                block_hashes[:max_blocks], hits, self.blocks_for(num_tokens)):
            hits = self._device_hits(block_hashes[:max_blocks])
        return hits, len(hits) * self.block_size

    def _device_hits(self, block_hashes: Sequence[int]) -> list[Block]:
        hits: list[Block] = []
        for block_hash in block_hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _onboard(self, block_hashes: Sequence[int], hits: list[Block], num_request_blocks: int) -> bool:
        """Copy the run of blocks after the pool's ``hits`` that a lower tier holds in host memory
        into fresh cached pool blocks, if the pool can also hold the rest of the request now."""
        found = []
        for block_hash in block_hashes[len(hits):]:
            stored = self.tiers.lookup(block_hash)
            if stored is None:
                break
            found.append(stored)
        num_evictable_hits = sum(1 for b in hits if b.ref_count == 0)
        if not found or num_request_blocks - len(hits) > self.pool.num_free_blocks - num_evictable_hits:
            return False
        self.pool.touch(hits)  # so that making room cannot evict them
        blocks = self.pool.allocate(len(found))
        self.tiers.load([b.block_id for b in blocks], found)
        parent = hits[-1].block_hash if hits else None
        self.pool.cache_blocks(blocks, [s.block_hash for s in found], parent,
                               [t for s in found for t in s.token_ids], self.block_size)
        self.pool.free(list(reversed(blocks)))
        self.pool.free(list(reversed(hits)))
        return True

    def prefetch(self, block_hashes: Sequence[int]) -> None:
        """Start bringing a new request's prefix up from disk (see ``is_loading``)."""
        if self.tiers is not None:  # the engine passes tiers only with prefix caching on
            self.tiers.prefetch(block_hashes, lambda h: self.pool.lookup(h) is not None)

    def is_loading(self, block_hashes: Sequence[int]) -> bool:
        """Whether blocks of this prompt are still being read from disk (schedule it later)."""
        return self.tiers is not None and self.tiers.is_loading(block_hashes)

    def allocate_slots(self, request_id: str, num_tokens: int,
                       cached_blocks: Sequence[Block] = ()) -> list[int] | None:
        """Make the request own enough blocks for ``num_tokens`` tokens in total.

        ``cached_blocks`` (from ``find_cached_prefix``) are adopted on the first allocation.
        Returns the request's full block table, or None (and changes nothing) if short of blocks.
        """
        owned = self._blocks.get(request_id)
        if owned is None:
            owned = []
        elif cached_blocks:
            raise RuntimeError(f"request {request_id} already owns blocks; cached prefix must come first")
        have = len(owned) + len(cached_blocks)
        need = max(0, self.blocks_for(num_tokens) - have)
        # cached hits sitting in the free queue leave it when adopted
        num_evictable_hits = sum(1 for b in cached_blocks if b.ref_count == 0)
        if need > self.pool.num_free_blocks - num_evictable_hits:
            return None
        if cached_blocks:
            self.pool.touch(cached_blocks)
            if self.tiers is not None:
                self.tiers.note_use(b.block_hash for b in cached_blocks)
            owned.extend(cached_blocks)
            self._num_cached[request_id] = len(cached_blocks)
        owned.extend(self.pool.allocate(need))
        self._blocks[request_id] = owned
        return [b.block_id for b in owned]

    def cache_computed(self, request_id: str, token_ids: Sequence[int], block_hashes: Sequence[int],
                       num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is now written as cached content."""
        num_full = min(num_computed_tokens // self.block_size, len(block_hashes))
        start = self._num_cached.get(request_id, 0)
        if num_full <= start:
            return
        blocks = self._blocks[request_id][start:num_full]
        bs = self.block_size
        self.pool.cache_blocks(
            blocks, block_hashes[start:num_full], block_hashes[start - 1] if start else None,
            token_ids[start * bs:num_full * bs], bs)
        if self.tiers is not None:
            self.tiers.note_use(block_hashes[start:num_full])
        self._num_cached[request_id] = num_full

    # -- peer fetch: blocks another worker writes into this pool, or reads out of it -----------------
    def reserve_fetch(self, owner: str, block_hashes: Sequence[int]) -> tuple[int, list[int]] | None:
        """Hold the blocks of a prompt's leading ``block_hashes`` for a peer to write the missing
        ones: the run cached here (pool, or onboarded from host memory) is adopted, fresh blocks
        are taken for the rest. Returns (blocks cached here, ids of the fresh blocks in order), or
        None (nothing changed) when the pool cannot hold them now. ``finish_fetch`` ends it."""
        if not self.pool.enable_caching:
            return None
        num_tokens = len(block_hashes) * self.block_size
        hits, _ = self.find_cached_prefix(block_hashes, num_tokens + 1)
        if len(hits) == len(block_hashes):
            return len(hits), []
        table = self.allocate_slots(owner, num_tokens, hits)
        if table is None:
            return None
        return len(hits), table[len(hits):]

    def finish_fetch(self, owner: str, token_ids: Sequence[int], block_hashes: Sequence[int],
                     num_filled_blocks: int) -> None:
        """The first ``num_filled_blocks`` of a ``reserve_fetch`` hold their KV now (the cached run
        included): they become cached content; every block goes back to the pool."""
        if num_filled_blocks:
            self.cache_computed(owner, token_ids, block_hashes, num_filled_blocks * self.block_size)
        self.free(owner)

    def lend(self, owner: str, block_hashes: Sequence[int]) -> list[int]:
        """Pin the leading run of ``block_hashes`` cached here (host-memory blocks onboarded into
        the pool) so a peer can read them; their ids, in order. ``free(owner)`` unpins them."""
        hits, _ = self.find_cached_prefix(block_hashes, len(block_hashes) * self.block_size + 1)
        if not hits:
            return []
        return self.allocate_slots(owner, len(hits) * self.block_size, hits) or []

    def free_out_of_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the request's leading blocks that the position ``num_computed_tokens`` (the next
        to compute) and every later one cannot see: those wholly before ``num_computed_tokens -
        window + 1``. The caller calls it once their KV is cached (``cache_computed``) and only for
        a request whose blocks nothing else will read whole (not a prefill a transfer sends).
        Returns how many blocks were given back now."""
        blocks = self._blocks.get(request_id)
        if self.window is None or not blocks:
            return 0
        first_seen = max(0, num_computed_tokens - self.window + 1)
        num_out = min(first_seen // self.block_size, len(blocks))
        start = self._num_dropped.get(request_id, 0)
        if num_out <= start:
            return 0
        self.pool.free(list(reversed(blocks[start:num_out])))  # the head of a prefix is kept longest
        self._num_dropped[request_id] = num_out
        return num_out - start

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks, tail first (the tail is evicted before the head)."""
        blocks = self._blocks.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        num_dropped = self._num_dropped.pop(request_id, 0)  # given back already
        if blocks:
            self.pool.free(list(reversed(blocks[num_dropped:])))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for request_id, blocks in self._blocks.items():
            for b in blocks[self._num_dropped.get(request_id, 0):]:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            if refs.get(b.block_id, 0) != b.ref_count:
                raise RuntimeError(
                    f"block {b.block_id}: ref_count {b.ref_count} but {refs.get(b.block_id, 0)} owners")
