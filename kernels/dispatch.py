"""Kernels for callers outside the model, each picking its Triton version on CUDA and its torch
reference elsewhere. (The model reaches its kernels through the backend of
shared/model/attention.py instead.) Reference modules never import their Triton kernels: triton is
absent on some platforms, and the dependency runs one way, kernel -> reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.kv_gather import gather_kv_blocks_ref


def gather_kv_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor | Sequence[int],
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``gather_kv_blocks_ref``'s contract: the Triton kernel on CUDA, the reference elsewhere."""
    if kv_cache.is_cuda:
        from kernels.kv_gather_triton import gather_kv_blocks_triton
        return gather_kv_blocks_triton(kv_cache, block_ids, out)
    return gather_kv_blocks_ref(kv_cache, block_ids, out)
