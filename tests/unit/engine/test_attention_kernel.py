"""Decode attention read in place from the paged KV pool (``kernels/cpu/decode_attention.cpp``, called
by the compiled decode step): it equals the written-out softmax the graph otherwise runs for float32,
bfloat16 and float16 pools with ragged lengths, grouped query heads and NaN in every unused slot;
a speculative row takes the positions its step computes from the step's rows; a sequence gets the
same bits alone, in any batch, whatever the longest sequence and with 1 or 2 threads; and the AVX2
build gives the AVX-512 build's bits."""

from __future__ import annotations

import pytest
import torch

from kernels import attention_cpu
from shared.engine.compiled.step import _decode_attention
from kernels.cpu_features import cpu_flags

HAS_AVX2 = all(f in cpu_flags() for f in ("avx2", "fma", "f16c"))
needs_kernel = pytest.mark.skipif(not HAS_AVX2, reason="the kernel needs AVX2, FMA and F16C")
HEADS, KV_HEADS, DIM, BLOCK, LAYERS, POOL = 9, 3, 64, 4, 2, 40


def case(lengths: list[int], dtype: torch.dtype, num_blocks: int, seed: int = 0, pool: int = POOL):
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    cache = torch.randn(pool, LAYERS, 2, BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    q = torch.randn(b, HEADS, DIM, generator=g)
    k = torch.randn(b, KV_HEADS, DIM, generator=g).to(dtype).float()
    v = torch.randn(b, KV_HEADS, DIM, generator=g).to(dtype).float()
    table = torch.randperm(pool, generator=g)[:b * num_blocks].view(b, num_blocks)
    valid = torch.arange(num_blocks * BLOCK)[None, :] < torch.tensor(lengths)[:, None]
    for row, n in enumerate(lengths):  # what a slot past a sequence's length holds must not matter
        for pos in range(n, num_blocks * BLOCK):
            cache[table[row, pos // BLOCK], :, :, pos % BLOCK] = float("nan")
    src = torch.full(valid.shape, -1, dtype=torch.long)
    return q, k, v, cache, table, valid, src


def big_case(lengths: list[int], dtype: torch.dtype):
    """``case`` with a block more than the longest row needs, over a pool large enough for every row's."""
    num_blocks = -(-max(lengths) // BLOCK) + 1
    return case(lengths, dtype, num_blocks, seed=3, pool=len(lengths) * num_blocks)


def written_out(q, k, v, cache, layer, table, valid, src):
    b, length = valid.shape
    past_k = cache[table.reshape(-1), layer, 0].reshape(b, length, KV_HEADS, DIM).float()
    past_v = cache[table.reshape(-1), layer, 1].reshape(b, length, KV_HEADS, DIM).float()
    from_step = (src >= 0)[:, :, None, None]
    past_k = torch.where(from_step, k[src.clamp(min=0)], past_k)
    past_v = torch.where(from_step, v[src.clamp(min=0)], past_v)
    return _decode_attention(q, k, v, past_k, past_v, valid[:, :, None, None])


def run(q, k, v, cache, layer, table, valid, src):
    assert attention_cpu.load(), attention_cpu.identity()  # loaded here too when a test runs alone
    return attention_cpu.decode_attention(q, k, v, cache, layer, table.reshape(-1), valid, src)


def test_the_kernel_is_built_and_loaded_where_the_cpu_has_avx2():
    assert attention_cpu.load() == HAS_AVX2, attention_cpu.identity()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernel_equals_the_written_out_softmax(dtype):
    q, k, v, cache, table, valid, src = case([5, 0, 23, 16], dtype, num_blocks=6)
    for layer in range(LAYERS):
        got = run(q, k, v, cache, layer, table, valid, src)
        assert not got.isnan().any()
        torch.testing.assert_close(got, written_out(q, k, v, cache, layer, table, valid, src), rtol=1e-5, atol=2e-6)


@needs_kernel
def test_a_speculative_row_reads_its_earlier_tokens_from_the_step():
    """Rows 0..2 are one entry's last token and two drafts at positions 7, 8, 9: row 2's past
    positions 7 and 8 are rows 0 and 1 of the step, not the pool (which holds NaN there)."""
    q, k, v, cache, table, valid, src = case([7, 8, 9], torch.float32, num_blocks=3, seed=1)
    table[:] = table[0]  # one sequence's blocks for all three rows
    for pos in range(7, 12):
        cache[table[0, pos // BLOCK], :, :, pos % BLOCK] = float("nan")
    src[1, 7] = 0
    src[2, 7], src[2, 8] = 0, 1
    got = run(q, k, v, cache, 1, table, valid, src)
    assert not got.isnan().any()
    torch.testing.assert_close(got, written_out(q, k, v, cache, 1, table, valid, src), rtol=1e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch(dtype):
    q, k, v, cache, table, valid, src = case([30, 3, 17, 9], dtype, num_blocks=8, seed=2)
    batch = run(q, k, v, cache, 0, table, valid, src)
    for row in range(4):
        alone = run(q[row:row + 1], k[row:row + 1], v[row:row + 1], cache, 0, table[row:row + 1],
                    valid[row:row + 1], src[row:row + 1])
        assert torch.equal(alone[0], batch[row]), row
    # a shorter block table (the batch's longest sequence shorter) gives the same bits too
    short = run(q[1:2], k[1:2], v[1:2], cache, 0, table[1:2, :1], valid[1:2, :BLOCK], src[1:2, :BLOCK])
    assert torch.equal(short[0], batch[1])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_batch_of_ragged_lengths_equals_the_written_out_softmax(dtype):
    """Sixteen rows (sequence-major items), lengths on both sides of block boundaries, up to 36 blocks."""
    lengths = [0, 1, 3, 4, 5, 15, 16, 17, 33, 63, 64, 65, 100, 127, 138, 139]
    q, k, v, cache, table, valid, src = big_case(lengths, dtype)
    got = run(q, k, v, cache, 1, table, valid, src)
    assert not got.isnan().any()
    torch.testing.assert_close(got, written_out(q, k, v, cache, 1, table, valid, src), rtol=1e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_bits_do_not_depend_on_the_batch_size_or_the_threads(dtype, num_threads):
    """Batches of 1, 3, 8 and 16 rows run their items head-major or sequence-major and split them
    differently over the threads: every row gets the same bits in each."""
    lengths = [47, 2, 16, 31, 80, 9, 64, 33, 17, 1, 95, 48, 12, 70, 5, 128]
    q, k, v, cache, table, valid, src = big_case(lengths, dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        full = run(q, k, v, cache, 0, table, valid, src)
        for size in (1, 3, 8):
            for start in range(0, len(lengths), size):
                rows = slice(start, start + size)
                part = run(q[rows], k[rows], v[rows], cache, 0, table[rows], valid[rows], src[rows])
                assert torch.equal(part, full[rows]), (size, start)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_the_avx2_build_gives_the_bits_of_this_build(tmp_path):
    """Where the kernel is built with AVX-512 (its weighted sums 16 lanes wide), the AVX2 build of the
    same source, which CPUs without AVX-512 run, gives the same bits."""
    import re

    from kernels.cpu_build import build

    if "-mavx512f" not in attention_cpu._FLAGS:
        pytest.skip("this CPU's build is the AVX2 build")
    source = tmp_path / "decode_attention_avx2.cpp"
    source.write_text(re.sub(r"TORCH_LIBRARY\(tandem_attn,", "TORCH_LIBRARY(tandem_attn_avx2,",
                             attention_cpu.SOURCE.read_text()))
    torch.ops.load_library(str(build(source, ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"])))
    avx2 = torch.ops.tandem_attn_avx2.decode_attention
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, k, v, cache, table, valid, src = big_case([5, 0, 23, 16, 40, 1, 77, 64, 3], dtype)
        for layer in range(LAYERS):
            args = (q, k, v, cache, layer, table.reshape(-1), valid, src)
            assert torch.equal(avx2(*args), attention_cpu.decode_attention(*args)), (dtype, layer)
