"""FP8 (e4m3) quantize / dequantize of KV with one scale per block.

``x`` is ``[num_groups, *row]``: each leading index gets one float32 scale, ``amax(|row|) / 448``
(448 is e4m3's largest finite value; an all-zero row gets scale 1). The caller picks the
granularity by the view it passes: a slab of pool rows ``[n, L, 2, bs, Hkv, D]`` gives one scale per
block; ``slab.flatten(0, 2)`` one per (block, layer, K/V), which follows each layer's range more
closely at 4 bytes per ``bs * Hkv * D`` values. Halves the bytes of a bf16 KV transfer.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_kv_fp8_ref(
    x: torch.Tensor,  # [G, *row], any float dtype
) -> tuple[torch.Tensor, torch.Tensor]:  # ([G, *row] float8_e4m3fn, [G] float32 scales)
    rows = x.float().flatten(1)  # [G, R]
    amax = rows.abs().amax(dim=1) if rows.shape[1] else rows.new_zeros(rows.shape[0])
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (rows / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(x.shape), scales


def dequantize_kv_fp8_ref(
    x_fp8: torch.Tensor,  # [G, *row] float8_e4m3fn
    scales: torch.Tensor,  # [G] float32
    dtype: torch.dtype,
) -> torch.Tensor:  # [G, *row] dtype
    rows = x_fp8.float().flatten(1) * scales[:, None]
    return rows.to(dtype).view(x_fp8.shape)


def quantize_kv_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_kv_fp8_ref``'s contract: the Triton kernel on CUDA, the reference elsewhere."""
    if x.is_cuda:
        from kernels.kv_fp8_triton import quantize_kv_fp8_triton
        return quantize_kv_fp8_triton(x)
    return quantize_kv_fp8_ref(x)


def dequantize_kv_fp8(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize_kv_fp8_ref``'s contract: the Triton kernel on CUDA, the reference elsewhere."""
    if x_fp8.is_cuda:
        from kernels.kv_fp8_triton import dequantize_kv_fp8_triton
        return dequantize_kv_fp8_triton(x_fp8, scales, dtype)
    return dequantize_kv_fp8_ref(x_fp8, scales, dtype)
