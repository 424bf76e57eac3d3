"""Paged decode attention in Triton: split-K (flash-decoding) plus a reduce kernel.

Same contract as ``paged_decode_attention_ref``. One program handles one (sequence, KV head,
split): it loads the ``G = Hq / Hkv`` query heads that share the KV head as one ``[G, D]`` tile, so
each K/V byte is read once per group, and walks its slice of the context in ``BLOCK_N``-token tiles,
looking every token's page up in the block table (a tile may span several pages, so the tile size
does not depend on the block size). With more than one split, each program writes a partial output
normalised by its own softmax sum plus its log-sum-exp (base 2), and the reduce kernel merges the
splits. Splitting the context is what fills the GPU when the batch is small and contexts are long.

Page ids are read only from table entries that cover ``[0, seq_len)``: entries past a sequence's
blocks are never read, whatever they hold. A padding row with ``seq_len == 0`` gets a zero output
(the reference's is NaN). With a sliding window (``window``) a sequence's splits start no
earlier than its first visible position, ``seq_len - window``: a split wholly before it is empty,
and no table entry before it is read. The cache views need a contiguous head_dim; other strides are arbitrary
(they are per-layer slices of the pool, see shared/kvcache/layout.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels._triton_util import dot_args, online_softmax_step, paged_tile, round_to, tile_scores

_LOG2E = 1.4426950408889634
_BLOCK_N = 64
_MIN_TILES_PER_SPLIT = 4  # a split shorter than this costs more in the reduce than it saves


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    scale_log2, window,
    stride_qb, stride_qh,
    stride_kn, stride_kt, stride_kh,
    stride_vn, stride_vt, stride_vh,
    stride_bt,
    split_len,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP
    num_splits = tl.num_programs(2)  # a launch dimension, not a constexpr: no recompiles as it grows

    seq_len = tl.load(seq_lens_ptr + seq)
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)
    if WINDOWED:  # the query (position seq_len - 1) sees the keys from seq_len - window on
        split_start = tl.maximum(split_start, seq_len - window)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g  # query head h reads KV head h // GROUP, as in the reference

    # q: [BLOCK_G, BLOCK_D]; rows past GROUP are zero and never stored
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt

    # Every tile holds at least one valid token (its first: the loop runs from split_start, which the
    # query sees, and stops at split_end <= seq_len), so the running max is finite after the first tile.
    for start in range(split_start, split_end, BLOCK_N):
        tokens = start + offs_n
        t_mask = tokens < split_end
        scores, pages, slots, kv_mask = tile_scores(
            q, k_ptr, table_row, tokens, t_mask, d_mask, offs_d, kv_head * stride_kh, stride_kn, stride_kt,
            scale_log2, BLOCK_SIZE, DOT_PRECISION, EMULATE_BF16)
        scores = tl.where(t_mask[None, :], scores, float("-inf"))  # [BLOCK_G, BLOCK_N]
        v = paged_tile(v_ptr, pages, slots, kv_head * stride_vh, offs_d, kv_mask, stride_vn, stride_vt).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION, EMULATE_BF16)

    has_tokens = l_i > 0.0  # false only for a split that starts past seq_len
    out = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if WRITE_PARTIAL:
        # out_ptr: partial outputs [B, Hq, num_splits, D] f32; lse_ptr: [B, Hq, num_splits] f32
        row = (seq * num_q_heads + heads) * num_splits + split
        tl.store(out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=g_mask)
    else:
        # a single split: out_ptr is the final [B, Hq, D] output (contiguous)
        tl.store(out_ptr + (seq * num_q_heads + heads)[:, None] * HEAD_DIM + offs_d[None, :],
                 round_to(out, out_ptr.dtype.element_ty, EMULATE_BF16), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    partial_ptr, lse_ptr, out_ptr, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    row = tl.program_id(0)  # seq * Hq + q_head
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)  # finite unless seq_len == 0 (some split holds the last token)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # seq_len 0: all weights 0, output 0
    weights = tl.exp2(lse - lse_max)  # 0 for empty splits and padding
    partial = tl.load(partial_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(partial * weights[:, None], axis=0) / tl.maximum(tl.sum(weights, axis=0), 1e-30)
    out = round_to(out, out_ptr.dtype.element_ty, EMULATE_BF16)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, out, mask=d_mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough splits to put about two programs on every SM, but no split shorter than
    ``_MIN_TILES_PER_SPLIT`` tiles: a long context at a small batch is spread over the GPU, a
    large batch is not split at all."""
    wanted = triton.cdiv(2 * num_sms, num_seqs * num_kv_heads)
    most = max_seq_len // (_BLOCK_N * _MIN_TILES_PER_SPLIT)
    return max(1, min(wanted, most))


def _device_num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 1 elsewhere (the interpreter gains nothing from splitting)."""
    if device.type != "cuda":
        return 1
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def paged_decode_attention_triton(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D], strided
    v_cache: torch.Tensor,  # [N, bs, Hkv, D], strided
    block_tables: torch.Tensor,  # [B, M] int32
    seq_lens: torch.Tensor,  # [B] int32 (0: a padding row, zero output)
    scale: float,
    *,
    max_seq_len: int | None = None,  # >= every seq_len (longer ones are cut); default M * bs, no sync
    num_splits: int | None = None,  # default: plan_num_splits on this device
    out: torch.Tensor | None = None,  # [B, Hq, D] contiguous, q's dtype
    window: int | None = None,  # sliding window: the query sees its last ``window`` positions
) -> torch.Tensor:  # [B, Hq, D]
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0, f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache views need a contiguous head_dim"
    assert block_size & (block_size - 1) == 0, f"block_size {block_size} must be a power of two"
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.is_contiguous() and out.shape == q.shape
    if num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = plan_num_splits(num_seqs, num_kv_heads, max_seq_len, _device_num_sms(q.device))
    split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), _BLOCK_N) * _BLOCK_N
    num_splits = max(1, triton.cdiv(max_seq_len, split_len))  # drop splits that are always empty

    if num_splits == 1:
        partial, lse = out, out  # the split kernel writes the final output directly
    else:
        partial = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32,
                              device=q.device)
        lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, partial, lse,
        scale * _LOG2E, window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        split_len,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, WRITE_PARTIAL=num_splits > 1,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs M >= 16
        BLOCK_D=block_d, BLOCK_N=_BLOCK_N, WINDOWED=window is not None,
        **dot_args(q.dtype),
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs * num_q_heads,)](
            partial, lse, out, num_splits,
            HEAD_DIM=head_dim, BLOCK_S=max(16, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
            EMULATE_BF16=dot_args(q.dtype)["EMULATE_BF16"],
        )
    return out
