"""Sliding-window attention: the Triton prefill and decode kernels against their torch references
and a float64 oracle, a query at position p seeing the keys in (p - window, p]."""

import pytest
import torch

from kernel_cases import REL_TOL, attention_oracle, make_paged_kv, max_rel_err, query_start_loc
from kernels.decode_attention import paged_decode_attention_ref
from kernels.decode_attention_triton import paged_decode_attention_triton
from kernels.prefill_attention import paged_prefill_attention_ref
from kernels.prefill_attention_triton import paged_prefill_attention_triton


# (block_size, head_dim, group, num_kv_heads, q_lens, seq_lens, window, dtype): windows shorter than a
# block, than a query tile (Triton's 32 or 64, the reference's 64) and longer than a whole context;
# whole prompts, chunks over a cached prefix that straddle the window, one-token queries
PREFILL_CASES = [
    (16, 64, 1, 2, [40], [40], 8, torch.float32),
    (16, 64, 3, 1, [16, 5, 1], [16, 21, 40], 12, torch.float32),
    (32, 64, 2, 2, [33, 0, 70], [90, 10, 150], 40, torch.float32),
    (16, 128, 1, 2, [130], [200], 100, torch.bfloat16),
    (16, 64, 2, 1, [20], [20], 64, torch.float32),
]


@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads,q_lens,seq_lens,window,dtype", PREFILL_CASES)
def test_windowed_prefill_matches_reference(device, block_size, head_dim, group, num_kv_heads, q_lens, seq_lens,
                                            window, dtype):
    _, k_cache, v_cache, table = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim).to(dtype=dtype, device=device)
    qsl = query_start_loc(q_lens, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5

    out = paged_prefill_attention_triton(q, k_cache, v_cache, table, qsl, lens, scale, window=window)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, table, qsl, lens, scale, window=window)
    oracle = attention_oracle(q, k_cache, v_cache, table, q_lens, seq_lens, scale, window)

    assert torch.isfinite(out).all()
    assert max_rel_err(out, oracle) < REL_TOL[dtype]
    assert max_rel_err(ref, oracle) < REL_TOL[dtype]
    assert max_rel_err(out, ref) < 2 * REL_TOL[dtype]


def test_windowed_prefill_ignores_keys_before_the_window(device):
    """Changing key 0 changes the queries at positions 0 .. window - 1 alone."""
    window = 10
    _, k_cache, v_cache, table = make_paged_kv([40], 16, 1, 64, torch.float32, device)
    q = torch.randn(40, 2, 64, device=device)
    qsl, lens = query_start_loc([40], device), torch.tensor([40], dtype=torch.int32, device=device)
    runs = []
    for bump in (0.0, 1.0):
        k_cache[int(table[0, 0]), 0] += bump
        runs.append((paged_prefill_attention_triton(q, k_cache, v_cache, table, qsl, lens, 0.125, window=window),
                     paged_prefill_attention_ref(q, k_cache, v_cache, table, qsl, lens, 0.125, window=window)))
    for before, after in zip(*runs):
        torch.testing.assert_close(after[window:], before[window:], rtol=0, atol=0)
        assert (after[window - 1] - before[window - 1]).abs().max() > 1e-3


# (block_size, head_dim, group, num_kv_heads, seq_lens, window, dtype, num_splits): contexts shorter and
# longer than the window, windows shorter than a block and than a split's tile; several splits, some of them
# wholly before the window
DECODE_CASES = [
    (16, 64, 1, 2, [1, 8, 9, 40], 8, torch.float32, 1),
    (16, 64, 3, 1, [15, 16, 17, 100], 16, torch.float32, 3),
    (32, 128, 8, 1, [300, 5, 64], 70, torch.bfloat16, 4),
    (16, 64, 2, 2, [257], 200, torch.float32, None),
]


@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads,seq_lens,window,dtype,num_splits", DECODE_CASES)
def test_windowed_decode_matches_reference(device, block_size, head_dim, group, num_kv_heads, seq_lens, window,
                                           dtype, num_splits):
    pool, k_cache, v_cache, table = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device)
    # the blocks wholly before a sequence's window are never read: garbage there must not leak
    for i, seq_len in enumerate(seq_lens):
        for j in range(max(seq_len - window, 0) // block_size):
            pool[int(table[i, j])] = float("nan")
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype=dtype, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5

    out = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, scale, num_splits=num_splits,
                                        window=window)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale, window=window)
    oracle = attention_oracle(q, k_cache, v_cache, table, [1] * len(seq_lens), seq_lens, scale, window)

    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    assert max_rel_err(out, oracle) < REL_TOL[dtype]
    assert max_rel_err(ref, oracle) < REL_TOL[dtype]
    assert max_rel_err(out, ref) < 2 * REL_TOL[dtype]


def test_window_longer_than_the_context_changes_no_bit(device):
    """A window the context fits in gives the bits of no window, in both kernels."""
    seq_lens = [30, 7]
    _, k_cache, v_cache, table = make_paged_kv(seq_lens, 16, 1, 64, torch.float32, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(2, 2, 64, device=device)
    for fn in (paged_decode_attention_triton, paged_decode_attention_ref):
        torch.testing.assert_close(fn(q, k_cache, v_cache, table, lens, 0.125, window=30),
                                   fn(q, k_cache, v_cache, table, lens, 0.125), rtol=0, atol=0)
    q = torch.randn(37, 2, 64, device=device)
    qsl = query_start_loc(seq_lens, device)
    for fn in (paged_prefill_attention_triton, paged_prefill_attention_ref):
        torch.testing.assert_close(fn(q, k_cache, v_cache, table, qsl, lens, 0.125, window=64),
                                   fn(q, k_cache, v_cache, table, qsl, lens, 0.125), rtol=0, atol=0)


# every layer windowed (Mistral), and a Gemma-like model whose layer 0 alone is windowed, with soft-capped scores
WINDOWED_MODELS = {
    "all layers": dict(sliding_window=8, window_layers=(0, 1)),
    "gemma": dict(qk_norm="head", post_norms=True, activation="gelu_tanh", attention_scale=0.2, attn_softcap=2.0,
                  local_layers=(0,), local_rope_theta=100.0, sliding_window=8, window_layers=(0,)),
}


@pytest.mark.parametrize("family", WINDOWED_MODELS)
def test_windowed_model_forward_agrees_across_backends(device, family):
    """Prompts of 13 and 21 tokens over a window of 8, then a decode step of both: the layers hand
    their windows to each backend's kernels (and to the soft-capped attention)."""
    from kernel_cases import tiny_model
    from test_triton_backend import assert_forward_agrees_across_backends

    assert_forward_agrees_across_backends(tiny_model(torch.float32, device, **WINDOWED_MODELS[family]), device,
                                          torch.float32)
