"""Collate KV for transfer: gather a request's blocks into one contiguous slab, scatter it back.

A block is one row of the pool ``[num_blocks, num_layers, 2, block_size, Hkv, D]`` (every layer's
K and V of ``block_size`` tokens, see shared/kvcache/layout.py), so a request's KV is the rows of
its block ids. Gathering them into a slab turns pages scattered over the pool into one transfer;
scattering writes a received slab into the destination's (different) block ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def block_ids_tensor(block_ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids as an int64 tensor on ``device``."""
    return torch.as_tensor(block_ids, dtype=torch.int64, device=device)


def gather_kv_blocks_ref(
    kv_cache: torch.Tensor,  # [N, *row]: the pool
    block_ids: torch.Tensor | Sequence[int],  # [n]
    out: torch.Tensor | None = None,  # [n, *row], kv_cache's dtype, contiguous
) -> torch.Tensor:  # [n, *row]: out, or a new contiguous slab
    ids = block_ids_tensor(block_ids, kv_cache.device)
    if out is None:
        return kv_cache.index_select(0, ids)
    return torch.index_select(kv_cache, 0, ids, out=out)


def scatter_kv_blocks_ref(
    slab: torch.Tensor,  # [n, *row]
    kv_cache: torch.Tensor,  # [N, *row]: the pool, written in place
    block_ids: torch.Tensor | Sequence[int],  # [n], distinct
) -> None:
    # index_put rather than index_copy_, which has no float8 kernel on the CPU
    kv_cache[block_ids_tensor(block_ids, kv_cache.device)] = slab.to(kv_cache.dtype)

