"""Paged decode attention: Triton (split-K + reduce) against the torch reference and a float64 oracle."""

import pytest
import torch

from kernel_cases import REL_TOL, attention_oracle, make_paged_kv, max_rel_err
from kernels.decode_attention import paged_decode_attention_ref
from kernels.decode_attention_triton import paged_decode_attention_triton, plan_num_splits

# (block_size, head_dim, group, num_kv_heads, seq_lens, dtype, num_splits): each axis value of the
# issue's grid appears at least once; lengths cover 1, block boundaries (bs - 1, bs, bs + 1) and
# ragged mixes; num_splits > 1 exercises the reduce, including splits past a short sequence's end.
CASES = [
    (16, 64, 1, 2, [1], torch.float32, 1),
    (16, 128, 3, 2, [15, 16, 17, 1, 33], torch.bfloat16, 2),
    (32, 64, 8, 1, [31, 32, 33, 64, 5], torch.float32, 3),
    (128, 128, 1, 2, [1, 127, 128, 129, 300], torch.bfloat16, 4),
    (128, 64, 3, 1, [257], torch.float32, None),
    (32, 128, 8, 2, [100, 3], torch.bfloat16, 1),
    (16, 64, 3, 1, [1, 200], torch.float32, 5),
]


@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads,seq_lens,dtype,num_splits", CASES)
def test_decode_matches_reference(device, block_size, head_dim, group, num_kv_heads, seq_lens, dtype,
                                  num_splits):
    _, k_cache, v_cache, table = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype=dtype, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5

    out = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, scale, num_splits=num_splits)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale)
    oracle = attention_oracle(q, k_cache, v_cache, table, [1] * len(seq_lens), seq_lens, scale)

    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert max_rel_err(out, oracle) < REL_TOL[dtype]
    assert max_rel_err(ref, oracle) < REL_TOL[dtype]
    assert max_rel_err(out, ref) < 2 * REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tolerance_detects_off_by_one(device, dtype):
    """The tolerances are tight enough to see one key too few at a 300-token context."""
    seq_lens = [300, 300]
    _, k_cache, v_cache, table = make_paged_kv(seq_lens, 16, 2, 64, dtype, device, seed=1)
    q = torch.randn(2, 6, 64).to(dtype=dtype, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, 0.125, num_splits=2)
    assert max_rel_err(out, attention_oracle(q, k_cache, v_cache, table, [1, 1], seq_lens, 0.125)) \
        < REL_TOL[dtype]
    shorter = attention_oracle(q, k_cache, v_cache, table, [1, 1], [299, 299], 0.125)
    assert max_rel_err(out, shorter) > 3 * REL_TOL[dtype]


def test_decode_writes_into_out_and_handles_empty_batch(device):
    _, k_cache, v_cache, table = make_paged_kv([20], 16, 1, 64, torch.float32, device)
    q = torch.randn(1, 2, 64, device=device)
    lens = torch.tensor([20], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    assert paged_decode_attention_triton(q, k_cache, v_cache, table, lens, 0.125, out=out) is out
    empty = paged_decode_attention_triton(q[:0], k_cache, v_cache, table[:0], lens[:0], 0.125)
    assert empty.shape == (0, 2, 64)


@pytest.mark.parametrize("num_seqs,max_seq_len,expected", [
    (1, 32768, 33),  # 8 KV-head programs, 132 SMs: split to ~2 programs per SM
    (32, 8192, 2),
    (128, 32768, 1),  # the batch alone fills the GPU
    (1, 100, 1),  # too short to split
    (1, 1024, 4),  # capped: no split under 4 tiles of 64 tokens
])
def test_plan_num_splits(num_seqs, max_seq_len, expected):
    assert plan_num_splits(num_seqs, 8, max_seq_len, num_sms=132) == expected


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padding_row_with_no_context_gets_zeros(device, num_splits):
    """Batch padding (seq_len 0, say for a fixed-size captured batch) must not produce NaN."""
    _, k_cache, v_cache, table = make_paged_kv([40, 1], 16, 1, 64, torch.float32, device)
    q = torch.randn(2, 2, 64, device=device)
    lens = torch.tensor([40, 0], dtype=torch.int32, device=device)
    out = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, 0.125, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert max_rel_err(out[:1], attention_oracle(q[:1], k_cache, v_cache, table, [1], [40], 0.125)) \
        < REL_TOL[torch.float32]
