"""Paged prefill/extend attention: Triton against the torch reference and a float64 oracle."""

import pytest
import torch

from kernel_cases import REL_TOL, attention_oracle, make_paged_kv, max_rel_err, query_start_loc
from kernels.prefill_attention import paged_prefill_attention_ref
from kernels.prefill_attention_triton import paged_prefill_attention_triton

# (block_size, head_dim, group, num_kv_heads, q_lens, seq_lens, dtype): whole prompts (q_len ==
# seq_len), chunks over a cached prefix, a one-token query, an empty sequence in the middle, query
# tiles (64) and pages that end at different tokens.
CASES = [
    (16, 64, 1, 2, [1], [1], torch.float32),
    (16, 128, 3, 1, [16, 5, 1], [16, 21, 40], torch.bfloat16),
    (32, 64, 8, 1, [33, 0, 7], [33, 10, 64], torch.float32),
    (128, 128, 1, 2, [70, 130], [200, 130], torch.bfloat16),
    (128, 64, 3, 2, [129], [129], torch.float32),
    (32, 128, 8, 1, [40, 1], [90, 33], torch.bfloat16),
]


@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads,q_lens,seq_lens,dtype", CASES)
def test_prefill_matches_reference(device, block_size, head_dim, group, num_kv_heads, q_lens, seq_lens,
                                   dtype):
    _, k_cache, v_cache, table = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim).to(dtype=dtype, device=device)
    qsl = query_start_loc(q_lens, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5

    out = paged_prefill_attention_triton(q, k_cache, v_cache, table, qsl, lens, scale)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, table, qsl, lens, scale)
    oracle = attention_oracle(q, k_cache, v_cache, table, q_lens, seq_lens, scale)

    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert max_rel_err(out, oracle) < REL_TOL[dtype]
    assert max_rel_err(ref, oracle) < REL_TOL[dtype]
    assert max_rel_err(out, ref) < 2 * REL_TOL[dtype]


def test_prefill_is_causal(device):
    """Changing the last key changes only the last query's output."""
    seq_lens = [40]
    pool, k_cache, v_cache, table = make_paged_kv(seq_lens, 16, 1, 64, torch.float32, device)
    q = torch.randn(40, 2, 64, device=device)
    qsl = query_start_loc([40], device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    before = paged_prefill_attention_triton(q, k_cache, v_cache, table, qsl, lens, 0.125)
    last_block = int(table[0, 2])
    k_cache[last_block, 7] += 1.0  # token 39
    after = paged_prefill_attention_triton(q, k_cache, v_cache, table, qsl, lens, 0.125)
    torch.testing.assert_close(after[:39], before[:39], rtol=0, atol=0)
    assert (after[39] - before[39]).abs().max() > 1e-3


def test_prefill_with_explicit_max_query_len_and_out(device):
    seq_lens, q_lens = [50, 20], [10, 20]
    _, k_cache, v_cache, table = make_paged_kv(seq_lens, 32, 2, 64, torch.float32, device)
    q = torch.randn(30, 4, 64, device=device)
    qsl = query_start_loc(q_lens, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    got = paged_prefill_attention_triton(q, k_cache, v_cache, table, qsl, lens, 0.125,
                                         max_query_len=20, out=out)
    assert got is out
    assert max_rel_err(out, attention_oracle(q, k_cache, v_cache, table, q_lens, seq_lens, 0.125)) \
        < REL_TOL[torch.float32]
