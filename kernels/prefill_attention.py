"""Paged prefill/extend attention: ragged query lengths over a cached prefix, causal.

Sequence ``i`` owns queries ``q[query_start_loc[i]:query_start_loc[i+1]]``; they are the *last*
``q_len`` positions of its ``seq_lens[i]``-token context, whose K/V (including the new tokens')
is already in the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        table = block_tables[i, :num_blocks].long()
        k = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [L, Hkv, D]
        v = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        qi = q[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        ki = k.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, L, D]
        vi = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, L]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out
