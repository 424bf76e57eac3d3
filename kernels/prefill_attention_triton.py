"""Paged prefill/extend attention in Triton: ragged query lengths over a cached prefix, causal.

Same contract as ``paged_prefill_attention_ref``: sequence ``i``'s queries are the last
``q_len = query_start_loc[i+1] - query_start_loc[i]`` positions of its ``seq_lens[i]``-token
context, whose K/V (the new tokens' included) is already in the cache. One program handles
``BLOCK_M`` queries of one sequence and one query head (flash-attention forward with online
softmax); it reads K/V through the block table one ``BLOCK_N``-token tile at a time and stops at
the last key its queries can see. With a sliding window (``window``: query p sees the keys in
``(p - window, p]``) it starts at the first tile the earliest of its queries sees.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_util import dot_args, online_softmax_step, paged_tile, round_to, tile_scores

_LOG2E = 1.4426950408889634


def tile_config(dtype: torch.dtype) -> dict:
    """Tile sizes and warps per dtype, chosen so that nothing spills registers on sm_90 (see
    kernels/compile_check.py). float32 runs exact (ieee) dots, which need far more registers
    than bf16 tensor-core dots, hence smaller tiles."""
    if dtype == torch.float32:
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    scale_log2, window,
    stride_qt, stride_qh,
    stride_kn, stride_kt, stride_kh,
    stride_vn, stride_vt, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len  # tokens cached before this step's queries

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix_len + offs_m  # [BLOCK_M] absolute positions of the queries

    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt

    # The first and last keys any query of this tile sees. Without a window key 0 is visible to every
    # query, so each row has a finite max after the first tile; with one, a row may see nothing in the
    # first tiles, and its max stays -inf until it does (online_softmax_step allows for that).
    kv_end = tl.minimum(seq_len, prefix_len + (m_block + 1) * BLOCK_M)
    kv_start = 0
    if WINDOWED:
        kv_start = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(kv_start, kv_end, BLOCK_N):
        tokens = start + offs_n
        t_mask = tokens < kv_end
        scores, pages, slots, kv_mask = tile_scores(
            q, k_ptr, table_row, tokens, t_mask, d_mask, offs_d, kv_head * stride_kh, stride_kn, stride_kt,
            scale_log2, BLOCK_SIZE, DOT_PRECISION, EMULATE_BF16)
        visible = t_mask[None, :] & (tokens[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N]
        if WINDOWED:
            visible = visible & (tokens[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        v = paged_tile(v_ptr, pages, slots, kv_head * stride_vh, offs_d, kv_mask, stride_vn, stride_vt).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION, EMULATE_BF16)

    out = round_to(acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], out_ptr.dtype.element_ty, EMULATE_BF16)
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out, mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D], strided
    v_cache: torch.Tensor,  # [N, bs, Hkv, D], strided
    block_tables: torch.Tensor,  # [B, M] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    *,
    max_query_len: int | None = None,  # upper bound on query lengths; default: read from the device
    out: torch.Tensor | None = None,  # [T, Hq, D], q's dtype, head_dim contiguous
    window: int | None = None,  # sliding window: each query sees its last ``window`` positions
) -> torch.Tensor:  # [T, Hq, D]
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    assert num_q_heads % num_kv_heads == 0, f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache views need a contiguous head_dim"
    assert block_size & (block_size - 1) == 0, f"block_size {block_size} must be a power of two"
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    tiles = tile_config(q.dtype)
    grid = (triton.cdiv(max_query_len, tiles["BLOCK_M"]), num_seqs, num_q_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E, window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_D=triton.next_power_of_2(head_dim), WINDOWED=window is not None, **tiles,
        **dot_args(q.dtype),
        num_stages=2,
    )
    return out
