"""Paged decode attention: one query token per sequence, GQA, ragged context lengths."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32; entries past a sequence's blocks are ignored
    seq_lens: torch.Tensor,  # [B] int32: context length including the current token
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()
    # Entries past a sequence's own blocks may hold anything (padding, stale ids): point them at
    # block 0 so that the gather stays in range.
    block_starts = torch.arange(num_blocks, device=table.device) * block_size
    table = torch.where(block_starts[None, :] < seq_lens[:, None].to(table.device), table, 0)
    length = num_blocks * block_size
    # index_select copies whole [bs, Hkv, D] pages (contiguous even in the strided pool view)
    ids = table.reshape(-1)
    k = k_cache.index_select(0, ids).view(num_seqs, length, num_kv_heads * head_dim)
    v = v_cache.index_select(0, ids).view(num_seqs, length, num_kv_heads * head_dim)
    valid = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None].to(q.device)  # [B, L]
    # Slots past seq_len are not this sequence's K/V (stale or never written, possibly non-finite):
    # the mask is additive and a zero probability times a NaN is NaN, so zero them (in place: the
    # gathered copies are ours). Only those rows are touched: a masked_fill over the whole copy
    # cost as much as the attention itself.
    invalid = (~valid).view(-1).nonzero().view(-1)
    if invalid.numel():
        k.view(-1, num_kv_heads * head_dim).index_fill_(0, invalid, 0)
        v.view(-1, num_kv_heads * head_dim).index_fill_(0, invalid, 0)
    k = k.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, L, D]
    v = v.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.float()[:, :, None, :], k.float(), v.float(), attn_mask=valid[:, None, None, :],
        scale=scale, enable_gqa=num_kv_heads != num_q_heads)  # [B, Hq, 1, D]
    return out[:, :, 0].to(q.dtype)
