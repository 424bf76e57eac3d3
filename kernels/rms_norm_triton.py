"""Fused residual add + RMSNorm in Triton. Same contract as ``fused_add_rms_norm_ref``.

One program per token row: one read of x and residual, one write of the sum and of the normed
row, instead of the four elementwise passes of the torch version. All arithmetic is in float32
(bf16 values are widened on load), with roundings where the reference rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_util import interpreting, round_to


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
                         stride_x, stride_r, stride_o, stride_s, hidden, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        summed = round_to(x + r, sum_ptr.dtype.element_ty, EMULATE_BF16)
        tl.store(sum_ptr + row * stride_s + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / hidden + eps)
    normed = round_to(x * inv_rms, sum_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, round_to(w * normed, out_ptr.dtype.element_ty, EMULATE_BF16),
             mask=mask)


def fused_add_rms_norm_triton(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H], x's dtype; None for the first layer
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], new residual = x + residual [T, H])
    num_tokens, hidden = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((num_tokens, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        summed, residual = x, x  # nothing to add: the new residual is x itself, as in the reference
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        summed = torch.empty_like(x)
    if num_tokens == 0:
        return out, summed
    bf16 = interpreting() and torch.bfloat16 in (x.dtype, out.dtype)
    _add_rms_norm_kernel[(num_tokens,)](
        x, residual, weight.contiguous(), out, summed,
        x.stride(0), residual.stride(0), out.stride(0), summed.stride(0), hidden, eps,
        HAS_RESIDUAL=summed is not x, BLOCK=triton.next_power_of_2(hidden), EMULATE_BF16=bf16,
        num_warps=8 if hidden >= 4096 else 4,
    )
    return out, summed
