"""Paged decode attention: one query token per sequence, GQA, ragged context lengths."""

from __future__ import annotations

import torch


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
    group = num_q_heads // num_kv_heads
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()
    # Entries past a sequence's own blocks may hold anything (padding, stale ids): point them at
    # block 0 so that the gather stays in range.
    block_starts = torch.arange(num_blocks, device=table.device) * block_size
    used = block_starts[None, :] < seq_lens[:, None].to(table.device)  # [B, num_blocks]
    table = torch.where(used, table, 0)
    # k, v: [B, L, Hkv, D] with L = num_blocks * block_size
    k = k_cache[table].reshape(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache[table].reshape(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    positions = torch.arange(k.shape[1], device=q.device)
    invalid = positions[None, :] >= seq_lens[:, None].to(q.device)  # [B, L]
    # Slots past seq_len are not K/V of this sequence (stale or never written, possibly non-finite):
    # a zero probability times a NaN would still poison the output, so zero them.
    v = v.masked_fill(invalid[:, :, None, None], 0)
    qg = q.view(num_seqs, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k.float()) * scale  # [B, Hkv, G, L]
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v.float())
    return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)
