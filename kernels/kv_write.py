"""Write new tokens' K/V into the paged cache (vLLM's reshape_and_cache).

Cache layout (see shared/kvcache/layout.py): one layer's view is
``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``, strided (blocks of all
layers are interleaved), so the write indexes (block, offset) rather than a flat slot.
"""

from __future__ import annotations

import torch


def write_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset
) -> None:
    block_size = k_cache.shape[1]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - block_ids * block_size
    k_cache[block_ids, offsets] = key.to(k_cache.dtype)
    v_cache[block_ids, offsets] = value.to(v_cache.dtype)
