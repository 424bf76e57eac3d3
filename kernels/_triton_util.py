"""Helpers shared by the Triton kernel wrappers and kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (the kernels then run on the CPU, through numpy)."""
    return bool(triton.knobs.runtime.interpret)


def dot_args(dtype: torch.dtype) -> dict:
    """Constexprs that choose how the attention kernels feed ``tl.dot`` and round to ``dtype``.

    float32 inputs use exact ``ieee`` products (TF32 would fail the float32 tolerances).
    The interpreter mishandles bfloat16: its ``tl.dot`` multiplies the raw uint16 bits and its
    float32 -> bfloat16 cast truncates. Under the interpreter, bfloat16 kernels therefore widen dot
    operands to float32 (exact: the GPU's bf16 products are exact in float32 too) and round to
    nearest even by hand, so that they compute what the GPU computes up to summation order.
    """
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "EMULATE_BF16": interpreting() and dtype == torch.bfloat16,
    }


@triton.jit
def attention_dot(a, b, DOT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``a @ b`` with float32 accumulation; see ``dot_args``."""
    if EMULATE_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest-even also under the interpreter; see ``dot_args``."""
    if EMULATE_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)  # exact: the low 16 bits are zero
    return x.to(dtype)


@triton.jit
def page_slots(table_row, tokens, mask, BLOCK_SIZE: tl.constexpr):
    """The cache page (int64) and the slot in it of each of ``tokens``, read from the sequence's
    block-table row at ``table_row``; a masked token reads no entry and gets page 0."""
    pages = tl.load(table_row + tokens // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    return pages, tokens % BLOCK_SIZE


@triton.jit
def paged_tile(cache_ptr, pages, slots, head_offset, offs_d, mask, stride_n, stride_t):
    """One KV head's ``[BLOCK_N, BLOCK_D]`` rows of a paged cache, row i at (``pages[i]``,
    ``slots[i]``); ``head_offset`` is the head's offset (``kv_head * stride_h``); masked elements 0."""
    rows = pages * stride_n + slots * stride_t + head_offset
    return tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def tile_scores(q, k_ptr, table_row, tokens, t_mask, d_mask, offs_d, head_offset, stride_n, stride_t, scale_log2,
                BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``q`` ``[M, D]`` against the keys of ``tokens`` ``[N]`` (``t_mask``: which are real) in a paged
    K cache: the scores ``[M, N]`` times ``scale_log2``, unmasked; and the tokens' pages, slots and
    ``[N, D]`` mask, for reading their values at the same places."""
    pages, slots = page_slots(table_row, tokens, t_mask, BLOCK_SIZE)
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = paged_tile(k_ptr, pages, slots, head_offset, offs_d, kv_mask, stride_n, stride_t)
    scores = attention_dot(q, tl.trans(k.to(q.dtype)), DOT_PRECISION, EMULATE_BF16) * scale_log2
    return scores, pages, slots, kv_mask


@triton.jit
def online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """One key tile of flash attention's online softmax, in base 2: folds ``scores`` ``[M, N]``
    (scaled by log2(e), -inf where a key is not seen) and ``v`` ``[N, D]`` into the running max
    ``m_i`` ``[M]``, sum ``l_i`` ``[M]`` and output ``acc`` ``[M, D]`` (float32); returns them.
    A row that has seen no key yet keeps max -inf and sum 0 (its rescale never computes -inf - -inf)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = round_to(p, v.dtype, EMULATE_BF16)
    acc = acc * alpha[:, None] + attention_dot(p, v, DOT_PRECISION, EMULATE_BF16)
    return m_new, l_i, acc
