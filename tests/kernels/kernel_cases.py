"""Builders and an independent float64 oracle shared by the kernel tests.

Caches are per-layer views of a 2-layer pool (layer 1), so every kernel sees the strided layout
of shared/kvcache/layout.py. Block tables use shuffled block ids and pad past each sequence's
blocks with an out-of-range id; slots a sequence does not own hold NaN. A kernel that reads past
a sequence's context therefore crashes or returns NaN instead of passing by luck.
"""

from __future__ import annotations

import torch

NUM_LAYERS = 2
LAYER = 1
# Max relative L2 error per output row ([D] vector of one token and head) against the float64
# oracle. bfloat16 output rounding alone is ~2e-3; dropping one key of a 300-token context moves
# rows by ~1e-2, which test_tolerance_detects_off_by_one checks these bounds still catch.
REL_TOL = {torch.float32: 2e-6, torch.bfloat16: 4e-3}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_paged_kv(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device, seed: int = 0, spare_blocks: int = 2):
    """Returns (pool, k_cache, v_cache, block_tables [B, M] int32)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    width = max(blocks_per_seq) + 1  # one padding column past the longest sequence
    pool = torch.full((num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim), float("nan"))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seq_lens), width), 10**6, dtype=torch.int32)  # out of range on purpose
    for i, (seq_len, count) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = [order.pop() for _ in range(count)]
        table[i, :count] = torch.tensor(ids, dtype=torch.int32)
        for j, block_id in enumerate(ids):
            filled = min(block_size, seq_len - j * block_size)
            pool[block_id, :, :, :filled] = torch.randn(NUM_LAYERS, 2, filled, num_kv_heads, head_dim,
                                                        generator=gen)
    pool = pool.to(dtype=dtype, device=device)
    return pool, pool[:, LAYER, 0], pool[:, LAYER, 1], table.to(device)


def query_start_loc(q_lens: list[int], device: torch.device) -> torch.Tensor:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)


def attention_oracle(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, q_lens: list[int], seq_lens: list[int],
                     scale: float, window: int | None = None) -> torch.Tensor:
    """float64 causal attention of each sequence's last ``q_len`` positions: [T, Hq, D]. With
    ``window``, a query at position p sees the keys in (p - window, p], and a position outside every
    window may hold anything (NaN included)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        ids = block_tables[i, :cdiv(seq_len, block_size)].long().cpu()
        k = k_cache.cpu()[ids].flatten(0, 1)[:seq_len].double().repeat_interleave(group, dim=1)
        v = v_cache.cpu()[ids].flatten(0, 1)[:seq_len].double().repeat_interleave(group, dim=1)
        if window is not None:
            k, v = torch.nan_to_num(k), torch.nan_to_num(v)
        qi = q[start:start + q_len].cpu().double()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        keys = torch.arange(seq_len)[None, :]
        hidden = keys > q_pos if window is None else (keys > q_pos) | (keys <= q_pos - window)
        scores.masked_fill_(hidden, float("-inf"))
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


def max_rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest relative L2 error over rows of the last dimension."""
    out, expected = out.cpu().double(), expected.cpu().double()
    err = (out - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-6)
    return float(err.max())


def tiny_model(dtype: torch.dtype, device, **family):
    """A 2-layer Llama with random weights (64 wide, 4 query heads over 2 KV heads of 16); ``family``:
    ``ModelConfig`` fields another family sets (post-norms, q/k norms, ...), with the weights they need."""
    from shared.model.config import ModelConfig
    from shared.model.llama import LlamaModel

    cfg = ModelConfig("llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=256, tie_word_embeddings=True, **family)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.1):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim

    def layer() -> dict:
        w = dict(attn_norm=1 + rand(64), qkv=rand(qkv_rows, 64), o_proj=rand(64, 64), mlp_norm=1 + rand(64),
                 gate_up=rand(256, 64), down=rand(64, 128))
        if not cfg.pre_norms:
            del w["attn_norm"], w["mlp_norm"]
        if cfg.post_norms:
            w.update(attn_out_norm=1 + rand(64), mlp_out_norm=1 + rand(64))
        if cfg.qk_norm:
            d = cfg.head_dim
            q, k = (cfg.num_heads * d, cfg.num_kv_heads * d) if cfg.qk_norm == "whole" else (d, d)
            w.update(q_norm=1 + rand(q), k_norm=1 + rand(k))
        return w

    layers = [layer() for _ in range(cfg.num_layers)]
    return LlamaModel(cfg, dict(embed=rand(97, 64, scale=1.0), norm=1 + rand(64)), layers)
