"""Write new tokens' K/V into the paged cache (vLLM's reshape_and_cache).

Cache layout (see shared/kvcache/layout.py): one layer's view is
``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``, strided (blocks of all
layers are interleaved), so the write indexes (block, offset) rather than a flat slot.
"""

from __future__ import annotations

import torch

from kernels.cast import cast


def kv_write_plan(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids, offsets in the block) of each new token: the same for every layer of a step."""
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    return block_ids, slot_mapping - block_ids * block_size


def write_kv_planned(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    plan: tuple[torch.Tensor, torch.Tensor],  # from kv_write_plan
) -> None:
    k_cache[plan] = cast(key, k_cache.dtype)
    v_cache[plan] = cast(value, v_cache.dtype)


def write_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset
) -> None:
    write_kv_planned(key, value, k_cache, v_cache, kv_write_plan(slot_mapping, k_cache.shape[1]))
