"""Write new tokens' K/V into the paged cache (vLLM's reshape_and_cache).

Cache layout (see shared/kvcache/layout.py): one layer's view is
``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``, strided (blocks of all
layers are interleaved), so the write indexes (block, offset) rather than a flat slot. A negative slot is a padding row
(a CUDA graph's batch is padded to its captured size): nothing is written for it.
"""

from __future__ import annotations

import torch

from kernels.cast import cast


def kv_write_plan(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, ...]:
    """(block ids, offsets in the block) of each new token, the same for every layer of a step; with
    a third entry, the rows to write, when some slots are padding (negative)."""
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        rows = (slot_mapping >= 0).nonzero().view(-1)
        slot_mapping = slot_mapping[rows]
    else:
        rows = None
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    plan = (block_ids, slot_mapping - block_ids * block_size)
    return plan if rows is None else (*plan, rows)


def write_kv_planned(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    plan: tuple[torch.Tensor, ...],  # from kv_write_plan
) -> None:
    if len(plan) == 3:
        key, value, plan = key[plan[2]], value[plan[2]], plan[:2]
    k_cache[plan] = cast(key, k_cache.dtype)
    v_cache[plan] = cast(value, v_cache.dtype)


def write_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset; negative: padding
) -> None:
    write_kv_planned(key, value, k_cache, v_cache, kv_write_plan(slot_mapping, k_cache.shape[1]))
