"""The grouped linear layer of a mixture of experts in Triton. Same contract as
``grouped_linear_ref`` (moe_grouped.py): every expert's rows in one launch, no host sync.

The grid is (row tiles, N tiles). Expert e owns ceil(counts[e] / BLOCK_M) consecutive row tiles;
each program loads the E counts, takes their prefix sums itself (no launch before it, nothing read
back on the host) and finds its expert as the number of experts whose tiles end at or before its
own. The grid is sized from shapes alone, ceil(P / BLOCK_M) + E tiles (every expert wastes less
than one tile), so it does not depend on the counts and a CUDA graph can capture the launch; the
programs past the last expert's tiles return at once.

float32 accumulation; the result is rounded to x's dtype as ``F.linear`` rounds it, then scaled
(in float32) and rounded to the output dtype. Tiles (``tile_config``) are chosen to compile
without spills on sm_90, not tuned for speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_util import attention_dot, dot_args, round_to


@triton.jit
def _grouped_linear_kernel(
    x_ptr, w_ptr, out_ptr, counts_ptr, rows_ptr, scale_ptr,
    num_experts, N, K, stride_x, stride_we, stride_wn, stride_out,
    HAS_ROWS: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    tile = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0).to(tl.int32)  # [BLOCK_E]
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, axis=0)  # inclusive: expert e's tiles are [tile_ends[e] - tiles[e], tile_ends[e])
    expert = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)  # padding experts own no tiles
    if expert >= num_experts:
        return  # past the last tile: the grid is sized for the worst case
    before = experts < expert
    first_tile = tl.sum(tl.where(before, tiles, 0), axis=0)
    row_start = tl.sum(tl.where(before, counts, 0), axis=0)  # the exclusive prefix sum
    row_end = row_start + tl.sum(tl.where(experts == expert, counts, 0), axis=0)

    offs_m = row_start + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] output rows
    mask_m = offs_m < row_end
    if HAS_ROWS:
        src = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        src = offs_m.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_ptr + src[:, None] * stride_x + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]: W[e]^T
        acc += attention_dot(a, b, DOT_PRECISION, EMULATE_BF16)
    y = round_to(acc, x_ptr.dtype.element_ty, EMULATE_BF16)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
        y = y.to(tl.float32) * scale[:, None]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out, round_to(y, out_ptr.dtype.element_ty, EMULATE_BF16), mask=mask_m[:, None] & mask_n[None, :])


def tile_config(num_rows: int, num_experts: int) -> dict[str, int]:
    """BLOCK_M from the mean rows per expert: 16 for a decode step's few, up to 64 for a prefill's
    many. BLOCK_N 128 below 64 rows: at 16 x 64, ptxas caps the kernel at 64 registers and spills
    (ptxas 13.4, sm_90); at 64 x 128 a float32 kernel nears 255."""
    mean = num_rows // max(num_experts, 1)
    rows = 16 if mean <= 16 else 32 if mean <= 32 else 64
    return {"BLOCK_M": rows, "BLOCK_N": 128 if rows < 64 else 64, "BLOCK_K": 64}


def grouped_linear_triton(
    x: torch.Tensor,  # [R, K]: the input rows (R = P, in order, where rows is None)
    weight: torch.Tensor,  # [E, N, K]
    counts: torch.Tensor,  # [E] int, on x's device: rows per expert, summing to P
    rows: torch.Tensor | None = None,  # [P] int: the input row of each output row
    scale: torch.Tensor | None = None,  # [P]: a factor per output row
) -> torch.Tensor:  # [P, N], x's dtype promoted with scale's
    num_experts, n, k = weight.shape
    num_rows = x.shape[0] if rows is None else rows.shape[0]
    assert x.shape[1] == k and counts.shape == (num_experts,), (x.shape, weight.shape, counts.shape)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out_dtype = x.dtype if scale is None else torch.promote_types(x.dtype, scale.dtype)
    out = torch.empty(num_rows, n, dtype=out_dtype, device=x.device)
    if num_rows == 0:
        return out
    tiles = tile_config(num_rows, num_experts)
    grid = (triton.cdiv(num_rows, tiles["BLOCK_M"]) + num_experts, triton.cdiv(n, tiles["BLOCK_N"]))
    _grouped_linear_kernel[grid](
        x, weight, out, counts, x if rows is None else rows, x if scale is None else scale.contiguous(),
        num_experts, n, k, x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        HAS_ROWS=rows is not None, HAS_SCALE=scale is not None,
        **tiles, BLOCK_E=triton.next_power_of_2(num_experts),
        **dot_args(x.dtype), num_warps=4, num_stages=3,
    )
    return out
