"""The C++ prefill attention for AVX-512 CPUs (``kernels/cpu/prefill_attention.cpp``) against a float64
oracle and the torch reference: pools of float32, bfloat16 and float16 read in place (NaN in every
slot a sequence does not own, block tables padded out of range), grouped queries, chunks over a cached
prefix, sliding windows, head dims from 16 to 128; and its rows' bits independent of the threads."""

import pytest
import torch

from kernel_cases import attention_oracle, make_paged_kv, max_rel_err, query_start_loc
from kernels import prefill_attention
from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

# (block_size, head_dim, group, num_kv_heads, q_lens, seq_lens, window): whole prompts and chunks over a
# cached prefix, one-token and empty queries, windows shorter than a block, than a tile and than a context
CASES = [
    (16, 64, 3, 3, [700], [700], None),
    (16, 64, 3, 1, [16, 5, 1], [16, 21, 40], None),
    (32, 32, 2, 2, [33, 0, 70], [90, 10, 150], None),
    (16, 128, 1, 2, [130], [200], None),
    (16, 16, 4, 1, [65, 64], [65, 300], None),
    (16, 80, 2, 1, [50], [120], None),
    (16, 64, 1, 2, [40], [40], 8),
    (16, 64, 3, 1, [16, 5, 1], [16, 21, 40], 12),
    (32, 64, 2, 2, [33, 0, 70], [90, 10, 150], 40),
    (16, 64, 2, 1, [200], [260], 64),
]
# relative L2 error per row against float64: the reference's and the kernel's sums are both float32
REL_TOL = 2e-6


@pytest.fixture(autouse=True)
def _kernel_here():
    probe = torch.zeros(1, 1, 16)
    if not prefill_attention.usable(probe, torch.zeros(1, 16, 1, 16)):
        pytest.skip(f"no CPU prefill attention kernel here: {prefill_attention.identity()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads,q_lens,seq_lens,window", CASES)
def test_the_kernel_is_causal_attention_over_the_pool(block_size, head_dim, group, num_kv_heads, q_lens, seq_lens,
                                                      window, dtype):
    cpu = torch.device("cpu")
    _, k_cache, v_cache, table = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, cpu)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(5))
    qsl, lens, scale = query_start_loc(q_lens, cpu), torch.tensor(seq_lens, dtype=torch.int32), head_dim ** -0.5

    out = paged_prefill_attention(q, k_cache, v_cache, table, qsl, lens, scale, window=window)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, table, qsl, lens, scale, window=window)
    oracle = attention_oracle(q, k_cache, v_cache, table, q_lens, seq_lens, scale, window)

    assert torch.isfinite(out).all()
    assert max_rel_err(out, oracle) < REL_TOL
    assert max_rel_err(ref, oracle) < REL_TOL  # the two agree with the oracle equally well


def test_a_rows_bits_do_not_depend_on_the_threads():
    cpu = torch.device("cpu")
    seq_lens, q_lens = [300, 90, 17], [300, 40, 17]
    _, k_cache, v_cache, table = make_paged_kv(seq_lens, 16, 3, 64, torch.float16, cpu)
    q = torch.randn(sum(q_lens), 9, 64, generator=torch.Generator().manual_seed(6))
    args = (q, k_cache, v_cache, table, query_start_loc(q_lens, cpu), torch.tensor(seq_lens, dtype=torch.int32), 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_prefill_attention(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(paged_prefill_attention(*args), one)


def test_off_runs_the_reference_and_says_why(monkeypatch):
    monkeypatch.setenv("TANDEM_PREFILL_ATTENTION_KERNEL", "off")
    kernel = prefill_attention.CpuKernel(prefill_attention.SOURCE, [], "tandem_prefill_attn::prefill_attention",
                                         prefill_attention._fake, "TANDEM_PREFILL_ATTENTION_KERNEL", (),
                                         module={}, fallback="reference", say=lambda *a: None, message="%s")
    assert not kernel.load()
    assert kernel.identity == "reference: TANDEM_PREFILL_ATTENTION_KERNEL=off"
