"""Rotary embedding of queries and keys in one Triton launch. Same contract as
``rotary_embedding_ref``.

One program per token rotates all its query heads and key heads: cos/sin are read once per token,
q and k (often strided slices of the fused qkv projection) once each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_util import interpreting, round_to


@triton.jit
def _round(x, COMPUTE_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Round a float32 intermediate to the compute dtype, as torch does after each bf16 op.

    Always by hand (integer round-to-nearest-even), also when compiled for the GPU: a cast to
    bfloat16 and straight back is a pair the compiler may drop, and then the products are not
    rounded and ``x1 * c - x2 * s`` may become one FMA, so that 4% of the outputs were one bf16 ulp
    off the reference on an H200. The bit operations cannot be folded and cost nothing here.
    """
    if COMPUTE_BF16:
        return round_to(x, tl.bfloat16, True).to(tl.float32)
    return x


@triton.jit
def _rotate_heads(x_ptr, out_ptr, stride_xt, stride_xh, token, num_heads, c, s,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  COMPUTE_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HALF)[None, :]
    src = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_HALF]
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    c = c[None, :]
    s = s[None, :]
    o1 = _round(_round(x1 * c, COMPUTE_BF16, EMULATE_BF16) - _round(x2 * s, COMPUTE_BF16, EMULATE_BF16),
                COMPUTE_BF16, EMULATE_BF16)
    o2 = _round(_round(x2 * c, COMPUTE_BF16, EMULATE_BF16) + _round(x1 * s, COMPUTE_BF16, EMULATE_BF16),
                COMPUTE_BF16, EMULATE_BF16)
    dst = out_ptr + token * num_heads * (2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(dst, round_to(o1, out_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)
    tl.store(dst + HALF, round_to(o2, out_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
                   NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   COMPUTE_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos_ptr + token * stride_ct + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_st + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, token, NUM_Q_HEADS, c, s,
                  HALF, BLOCK_QH, BLOCK_HALF, COMPUTE_BF16, EMULATE_BF16)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, token, NUM_KV_HEADS, c, s,
                  HALF, BLOCK_KH, BLOCK_HALF, COMPUTE_BF16, EMULATE_BF16)


def rotary_embedding_triton(
    q: torch.Tensor,  # [T, Hq, D], head_dim contiguous (other strides free)
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D/2]
    sin: torch.Tensor,  # [T, D/2]
) -> tuple[torch.Tensor, torch.Tensor]:  # (q rotated [T, Hq, D], k rotated [T, Hkv, D]), contiguous
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and cos.shape == sin.shape == (num_tokens, head_dim // 2)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    compute_bf16 = torch.promote_types(q.dtype, cos.dtype) == torch.bfloat16
    _rotary_kernel[(num_tokens,)](
        q, k, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        BLOCK_QH=triton.next_power_of_2(num_q_heads), BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        COMPUTE_BF16=compute_bf16, EMULATE_BF16=interpreting(),
    )
    return q_out, k_out
