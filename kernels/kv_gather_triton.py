"""KV gather / scatter in Triton. Same contracts as ``gather_kv_blocks_ref`` /
``scatter_kv_blocks_ref``.

A pure copy of whole rows: tensors are reinterpreted as integers of their element size, so any
dtype (bf16, fp8, ...) moves bit for bit. Program (i, j) copies chunk ``j`` of row ``i``; offsets
are int64 because a pool's byte size exceeds 2**31 (one Llama-3-8B block of 16 tokens is 2 MiB).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.kv_gather import block_ids_tensor

_BLOCK = 4096
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, block_ids_ptr, row_numel, stride_src, stride_dst,
                      GATHER: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    block_id = tl.load(block_ids_ptr + i).to(tl.int64)
    if GATHER:  # pool row block_id -> slab row i
        src_row, dst_row = block_id, i.to(tl.int64)
    else:  # slab row i -> pool row block_id
        src_row, dst_row = i.to(tl.int64), block_id
    data = tl.load(src_ptr + src_row * stride_src + offs, mask=mask)
    tl.store(dst_ptr + dst_row * stride_dst + offs, data, mask=mask)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _copy_rows(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, gather: bool) -> None:
    assert src.dtype == dst.dtype, f"dtype mismatch: {src.dtype} vs {dst.dtype}"
    assert src.shape[1:] == dst.shape[1:], f"row shape mismatch: {tuple(src.shape)} vs {tuple(dst.shape)}"
    assert src[:1].flatten(1).is_contiguous() and dst[:1].flatten(1).is_contiguous(), \
        "rows must be contiguous"
    num_rows = ids.shape[0]
    row_numel = math.prod(src.shape[1:])
    if num_rows == 0 or row_numel == 0:
        return
    _copy_rows_kernel[(num_rows, triton.cdiv(row_numel, _BLOCK))](
        _as_bits(src), _as_bits(dst), ids, row_numel, src.stride(0), dst.stride(0),
        GATHER=gather, BLOCK=_BLOCK,
    )


def gather_kv_blocks_triton(
    kv_cache: torch.Tensor,  # [N, *row]: the pool
    block_ids: torch.Tensor | Sequence[int],  # [n]
    out: torch.Tensor | None = None,  # [n, *row], kv_cache's dtype, contiguous
) -> torch.Tensor:  # [n, *row]
    ids = block_ids_tensor(block_ids, kv_cache.device)
    if out is None:
        out = torch.empty((ids.shape[0], *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=kv_cache.device)
    assert out.shape == (ids.shape[0], *kv_cache.shape[1:]), \
        f"out {tuple(out.shape)} for {ids.shape[0]} blocks"
    _copy_rows(kv_cache, out, ids, gather=True)
    return out


def scatter_kv_blocks_triton(
    slab: torch.Tensor,  # [n, *row]
    kv_cache: torch.Tensor,  # [N, *row]: the pool, written in place
    block_ids: torch.Tensor | Sequence[int],  # [n], distinct
) -> None:
    ids = block_ids_tensor(block_ids, kv_cache.device)
    assert slab.shape[0] == ids.shape[0], f"{slab.shape[0]} slab rows for {ids.shape[0]} block ids"
    _copy_rows(slab.to(kv_cache.dtype), kv_cache, ids, gather=False)
