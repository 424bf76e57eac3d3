"""FP8 (e4m3) quantize / dequantize of KV in Triton. Same contracts as ``quantize_kv_fp8_ref`` /
``dequantize_kv_fp8_ref`` and bit-identical results.

Quantize runs one program per scale group: a first pass over the row finds ``amax``, a second
writes ``x / scale`` as e4m3 (IEEE division, so the bytes match torch's). Dequantize is an
elementwise ``fp8 * scale`` over (group, chunk) programs. e4m3 (``tl.float8e4nv``) needs a GPU of
compute capability 8.9 or newer (Ada, Hopper).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._triton_util import interpreting, round_to
from kernels.kv_fp8 import FP8_DTYPE, FP8_MAX

_BLOCK = 2048


@triton.jit
def _round_to_e4m3_grid(y):
    """Round float32 ``y`` (|y| <= 448) to the nearest e4m3 value, ties to even, in float32.

    The interpreter's float32 -> fp8 cast loses the carry when rounding up overflows the mantissa
    (127.9 becomes 64), so under the interpreter the kernel rounds first and the cast is then exact.
    """
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals share the spacing of 2**-6
    inv_spacing = ((127 + 3 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**(3 - exponent)
    spacing = ((127 - 3 + exponent) << 23).to(tl.float32, bitcast=True)
    magnitude = tl.abs(y) * inv_spacing  # exact (power of two), < 16
    rounded = ((magnitude + 8388608.0) - 8388608.0) * spacing  # 2**23: rounds to an integer, RNE
    sign = bits & -2147483648  # keep the sign of y, also of -0.0 and of values that round to 0
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, scales_ptr, row_numel, stride_x,
                     FP8_MAX: tl.constexpr, BLOCK: tl.constexpr, EMULATE_FP8: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * row_numel
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, row_numel, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < row_numel, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    row_amax = tl.max(amax, axis=0)
    scale = tl.where(row_amax > 0, tl.div_rn(row_amax, tl.full([], FP8_MAX, tl.float32)), 1.0)
    tl.store(scales_ptr + row, scale)
    for start in range(0, row_numel, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < row_numel
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        if EMULATE_FP8:
            y = _round_to_e4m3_grid(y)
        tl.store(out_row + offs, y.to(tl.float8e4nv), mask=mask)


@triton.jit
def _dequantize_kernel(x_ptr, scales_ptr, out_ptr, row_numel,
                       BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    scale = tl.load(scales_ptr + row)
    x = tl.load(x_ptr + row * row_numel + offs, mask=mask, other=0.0).to(tl.float32)
    out = round_to(x * scale, out_ptr.dtype.element_ty, EMULATE_BF16)
    tl.store(out_ptr + row * row_numel + offs, out, mask=mask)


def quantize_kv_fp8_triton(
    x: torch.Tensor,  # [G, *row]; each row contiguous, any row stride (e.g. a per-layer cache view)
) -> tuple[torch.Tensor, torch.Tensor]:  # ([G, *row] float8_e4m3fn contiguous, [G] float32)
    num_groups, row_numel = x.shape[0], math.prod(x.shape[1:])
    if not x[:1].flatten(1).is_contiguous():
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(num_groups, dtype=torch.float32, device=x.device)
    if num_groups == 0:
        return out, scales
    _quantize_kernel[(num_groups,)](
        x, out, scales, row_numel, x.stride(0),
        FP8_MAX=FP8_MAX, BLOCK=_BLOCK, EMULATE_FP8=interpreting(),
    )
    return out, scales


def dequantize_kv_fp8_triton(
    x_fp8: torch.Tensor,  # [G, *row] float8_e4m3fn, contiguous
    scales: torch.Tensor,  # [G] float32
    dtype: torch.dtype,
) -> torch.Tensor:  # [G, *row] dtype
    assert x_fp8.dtype == FP8_DTYPE, f"expected {FP8_DTYPE}, got {x_fp8.dtype}"
    x_fp8 = x_fp8.contiguous()
    num_groups, row_numel = x_fp8.shape[0], math.prod(x_fp8.shape[1:])
    out = torch.empty(x_fp8.shape, dtype=dtype, device=x_fp8.device)
    if num_groups == 0 or row_numel == 0:
        return out
    _dequantize_kernel[(num_groups, triton.cdiv(row_numel, _BLOCK))](
        x_fp8, scales.float().contiguous(), out, row_numel,
        BLOCK=_BLOCK, EMULATE_BF16=interpreting() and dtype == torch.bfloat16,
    )
    return out
