"""Write new tokens' K/V into the paged cache, in Triton. Same contract as ``write_kv_ref``.

One program per (token, tile of KV heads) copies that token's K and V rows to
``(slot // block_size, slot % block_size)`` of the strided per-layer cache views. Slots must be
valid (``0 <= slot < num_blocks * block_size``): there is no bounds check on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_util import interpreting, round_to


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_keyt, stride_keyh, stride_valt, stride_valh,
    stride_kn, stride_kt, stride_kh,
    stride_vn, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    token = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    mask = mask & (tl.full((BLOCK_H, BLOCK_D), 0, tl.int64) + slot >= 0)  # a negative slot: padding, no write
    page = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    token64 = token.to(tl.int64)

    k = tl.load(key_ptr + token64 * stride_keyt + offs_h[:, None] * stride_keyh + offs_d[None, :],
                mask=mask)
    k_dst = k_cache_ptr + page * stride_kn + offset * stride_kt + offs_h[:, None] * stride_kh
    tl.store(k_dst + offs_d[None, :], round_to(k, k_cache_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)
    v = tl.load(value_ptr + token64 * stride_valt + offs_h[:, None] * stride_valh + offs_d[None, :],
                mask=mask)
    v_dst = v_cache_ptr + page * stride_vn + offset * stride_vt + offs_h[:, None] * stride_vh
    tl.store(v_dst + offs_d[None, :], round_to(v, v_cache_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


def write_kv_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D], strided
    v_cache: torch.Tensor,  # [N, bs, Hkv, D], strided
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset; negative: padding
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache views need a contiguous head_dim"
    block_h = min(triton.next_power_of_2(num_kv_heads), 8)
    _write_kv_kernel[(num_tokens, triton.cdiv(num_kv_heads, block_h))](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(head_dim),
        EMULATE_BF16=interpreting() and k_cache.dtype == torch.bfloat16 and key.dtype != torch.bfloat16,
    )
