"""The KV pool's memory layout, chosen for transfer.

One tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: a block holds its
tokens' K and V for *every* layer in one contiguous slice. Moving a request's KV is therefore one
copy per block, not one per block per layer, and blocks with consecutive ids (what a fresh pool
hands out) merge into a single copy: a long prompt becomes a handful of large transfers.
Attention sees per-layer strided views ``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KvCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block

    def allocate(self, num_blocks: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(
            (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim),
            dtype=self.dtype, device=device)


def layer_views(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) of one layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    return kv_cache[:, layer, 0], kv_cache[:, layer, 1]


def contiguous_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Merge block ids into (first_block, num_blocks) runs of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs

