"""Paged decode attention: one query token per sequence, GQA, ragged context lengths.

The reference is split in two: ``decode_plan`` turns a step's block tables and lengths into the
gather indices and the mask, once per step, and ``paged_decode_attention_planned`` runs one layer
with them; the model's torch backend makes the plan once and reuses it in every layer.

Every sequence attends over whole blocks with the positions past its length masked, also when
every length in the step is the same: a row's result then does not depend on its batch-mates.
(Cut at its exact length without a mask, a sequence alone takes another path through SDPA than
in a ragged batch, and its last bits differ; with int8 linear layers that can flip a greedy token.)

With a sliding ``window``, the query at position ``p = seq_len - 1`` sees the keys in
``(p - window, p]`` (the last ``window`` positions, its own included; transformers'
``sliding_window_overlay``): the positions before are masked like padding, and a block wholly
before them is not read (its table entry may name a block that holds something else by now).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cast import cast


@dataclass(frozen=True)
class DecodePlan:
    block_ids: torch.Tensor  # [B * num_blocks] int64: the blocks to gather, padding entries -> block 0
    num_blocks: int  # per sequence, for the longest one
    valid: torch.Tensor  # [B, num_blocks * block_size] bool: the positions each sequence's query sees
    invalid_rows: torch.Tensor  # flat positions no query sees, zeroed after the gather (maybe none)


def decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                window: int | None = None) -> DecodePlan:
    """``window``: the sliding window of the layers that use the plan (None: the whole context)."""
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()
    ends = seq_lens[:, None].to(table.device)  # [B, 1]
    starts = torch.zeros_like(ends) if window is None else (ends - window).clamp(min=0)  # the first position seen
    block_starts = torch.arange(num_blocks, device=table.device) * block_size
    seen = (block_starts[None, :] < ends) & (block_starts[None, :] + block_size > starts)
    table = torch.where(seen, table, 0)
    positions = torch.arange(num_blocks * block_size, device=table.device)[None, :]
    valid = (positions < ends) & (positions >= starts)
    return DecodePlan(table.reshape(-1), num_blocks, valid, (~valid).view(-1).nonzero().view(-1))


def paged_decode_attention_planned(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    length = plan.num_blocks * block_size
    width = num_kv_heads * head_dim
    k = k_cache.index_select(0, plan.block_ids).view(num_seqs, length, num_kv_heads, head_dim)
    v = v_cache.index_select(0, plan.block_ids).view(num_seqs, length, num_kv_heads, head_dim)
    # zero the padding so that garbage (NaN/inf) in unused cache slots cannot leak through
    k.view(-1, width).index_fill_(0, plan.invalid_rows, 0)
    v.view(-1, width).index_fill_(0, plan.invalid_rows, 0)
    mask = plan.valid[:, None, None, :]
    # computed in float32 whatever the cache holds
    qf, k, v = cast(q, torch.float32), cast(k, torch.float32), cast(v, torch.float32)
    out = F.scaled_dot_product_attention(
        qf[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        scale=scale, enable_gqa=num_kv_heads != num_q_heads)  # [B, Hq, 1, D]
    return cast(out[:, :, 0], q.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32; entries past a sequence's blocks are ignored
    seq_lens: torch.Tensor,  # [B] int32: context length including the current token
    scale: float,
    window: int | None = None,  # sliding window: the query sees its last ``window`` positions
) -> torch.Tensor:  # [B, Hq, D]
    plan = decode_plan(block_tables, seq_lens, k_cache.shape[1], window)
    return paged_decode_attention_planned(q, k_cache, v_cache, plan, scale)
