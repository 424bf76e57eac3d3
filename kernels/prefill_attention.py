"""Paged prefill/extend attention: ragged query lengths over a cached prefix, causal.

Sequence ``i`` owns queries ``q[query_start_loc[i]:query_start_loc[i+1]]``; they are the *last*
``q_len`` positions of its ``seq_lens[i]``-token context, whose K/V (including the new tokens')
is already in the cache.

The reference computes each query's attention in the same call, whatever chunk of the prompt it
came in: queries go to SDPA in tiles of ``QUERY_TILE`` positions aligned to the start of the
sequence, each tile over the keys up to its own end (a query of an earlier chunk, or past the
chunk's end, fills its row with zeros and is dropped). A tile's call is then a function of the tile
alone, and so is every row of it: how the scheduler splits a prompt into chunks, which depends on
its batch-mates, cannot move a bit of the result. SDPA's result for a row otherwise depends on
which rows share its call and on how many keys are padded after it, and with int8 linear layers a
last-bit difference can flip an activation's rounding and change a greedy token.

With a sliding ``window``, the query at position ``p`` sees the keys in ``(p - window, p]`` (its
last ``window`` positions, its own included, as transformers' ``sliding_window_overlay``): one
more term of the mask, and a tile's call reads the keys from the first its first query sees on,
so it stays a function of the tile (and the window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# positions per SDPA call (torch's CPU kernel splits them in 32s). Any fixed size keeps each call a function of
# its tile; a prompt shorter than a tile pays for the whole tile, and 64 cost less than 128 at every length
# measured (16 to 2,000 tokens; loadtest/results/README.md, "Batch-invariant attention")
QUERY_TILE = 64


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    tile: int = QUERY_TILE,  # another size gives other bits: the engine keeps to QUERY_TILE
    window: int | None = None,  # sliding window: each query sees its last ``window`` positions
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
        first = seq_len - q_len  # position of the first query
        length = -(-seq_len // tile) * tile  # keys up to the end of the last tile
        k = q.new_zeros(length, num_kv_heads, head_dim)  # past seq_len: zeros, never NaN from the pool
        v = q.new_zeros(length, num_kv_heads, head_dim)
        k[:seq_len] = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v[:seq_len] = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, length, D]
        for a in range(first // tile * tile, seq_len, tile):
            b = a + tile
            lo, hi = max(a, first), min(b, seq_len)
            rows = q[q_start + lo - first:q_start + hi - first]  # [hi - lo, Hq, D]
            if hi - lo < tile:
                rows = torch.cat([rows.new_zeros(lo - a, *rows.shape[1:]), rows,
                                  rows.new_zeros(b - hi, *rows.shape[1:])])
            # the keys from the first one the tile's first query sees (a function of the tile and the window)
            k_lo = 0 if window is None else max(a - window + 1, 0)
            q_pos = torch.arange(a, b, device=q.device)
            keys = torch.arange(k_lo, b, device=q.device)[None, :]
            mask = keys <= q_pos[:, None]  # [tile, b - k_lo]
            if window is not None:
                mask &= keys > q_pos[:, None] - window
            o = F.scaled_dot_product_attention(rows.transpose(0, 1)[None], k[None, :, k_lo:b], v[None, :, k_lo:b],
                                               attn_mask=mask, scale=scale, enable_gqa=True)  # [1, Hq, tile, D]
            out[q_start + lo - first:q_start + hi - first] = o[0, :, lo - a:hi - a].transpose(0, 1)
    return out
