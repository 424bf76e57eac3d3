"""Weight-only blocks of 32 (``--quantization gguf``): a weight already on a 4-bit grid in every block,
as a GGUF file's Q4 layers are, is kept on that grid; any other weight gets symmetric 8-bit blocks;
activations are rounded per block to 8 bits as llama.cpp does; the AVX2 kernel
(``kernels/cpu/block_mm.cpp``) computes what its torch reference does, and gives a row the same bits
alone and in any batch (alone and in pairs it runs its narrow loops, from three rows its wide ones);
where the CPU has AVX-512 VNNI, the weight's panels give the same bits as those loops."""

from __future__ import annotations

import pytest
import torch

from kernels import blocks_cpu
from kernels.cpu_features import AVX512_VNNI_FLAGS, cpu_flags
from shared.model.quant import BLOCK, block_linear, four_bit_grid, quantize_blocks

HAS_AVX2 = all(f in cpu_flags() for f in ("avx2", "fma", "f16c"))
HAS_VNNI = HAS_AVX2 and all(f in cpu_flags() for f in AVX512_VNNI_FLAGS)


def q4_1_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight as ggml's Q4_1 dequantizes: per block of 32, float16 d and m, w = d * q + m."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // BLOCK, generator=g) * 0.01 + 0.001).half().float()
    m = (-torch.rand(n, k // BLOCK, generator=g) * 0.08).half().float()
    q = torch.randint(0, 16, (n, k // BLOCK, BLOCK), generator=g).float()
    return (q * d[..., None] + m[..., None]).reshape(n, k)


WEIGHTS = {"q4_1": lambda: q4_1_weight(48, 96, seed=3),
           "float": lambda: torch.randn(44, 96, generator=torch.Generator().manual_seed(4))}


def test_the_kernel_is_built_and_loaded_where_the_cpu_has_avx2():
    assert blocks_cpu.load() == HAS_AVX2, blocks_cpu.identity()
    if HAS_AVX2:
        assert blocks_cpu.identity().startswith("block_mm-")


def test_a_q4_weight_keeps_its_own_levels():
    w = q4_1_weight(64, 128)
    q, step, lo = four_bit_grid(w)
    assert q.min() >= 0 and q.max() <= 15
    rebuilt = q.reshape(64, -1, BLOCK) * step[..., None] + lo[..., None]
    assert torch.allclose(rebuilt.reshape(64, 128), w, rtol=0, atol=1e-6)
    b = quantize_blocks(w)
    assert b.bits == 4 and b.shape == (64, 128) and b.qs.shape == (64, 64) and b.qs.dtype == torch.uint8
    assert torch.equal(b.levels().reshape(64, 128), q.float())  # ggml's nibble order, read back
    # only the block scale and offset move, by float16's rounding (11 significant bits)
    err = (b.dequantize() - w).abs().reshape(64, -1, BLOCK).amax(-1)
    assert bool((err <= (15 * step + lo.abs()) * 2 ** -10).all())


def test_a_block_that_is_constant_or_a_q4_0_block_fits_the_grid():
    w = q4_1_weight(16, 64)
    w[0, :BLOCK] = 0.25  # one value in the whole block
    g = torch.Generator().manual_seed(1)
    d = 0.02
    w[1, :BLOCK] = d * (torch.randint(3, 12, (BLOCK,), generator=g).float() - 8)  # Q4_0, levels 3..11 only
    w[1, 0], w[1, 1] = d * -5, d * -4  # two neighbouring levels: the step is found
    b = quantize_blocks(w)
    assert b.bits == 4
    assert torch.equal(b.dequantize()[0, :BLOCK], w[0, :BLOCK])
    assert torch.allclose(b.dequantize()[1, :BLOCK], w[1, :BLOCK], rtol=0, atol=(15 * d + 5 * d) * 2 ** -10)


def test_a_float_weight_gets_8_bit_blocks():
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(2)) * 0.05
    assert four_bit_grid(w) is None
    b = quantize_blocks(w)
    assert b.bits == 8 and b.qs.shape == (32, 96) and b.qs.dtype == torch.int8 and b.m is None
    amax = w.reshape(32, -1, BLOCK).abs().amax(-1)
    err = (b.dequantize() - w).abs().reshape(32, -1, BLOCK).amax(-1)
    # half an 8-bit step, and the float16 rounding of the scale over up to 127 levels
    assert bool((err <= amax / 127 * 0.5 + amax * 2 ** -10).all())
    # a Q8_0 weight (levels times a float16 scale) is kept exactly
    assert torch.equal(quantize_blocks(b.dequantize()).qs, b.qs)


def test_a_weight_whose_rows_are_not_whole_blocks_stays_float():
    assert quantize_blocks(torch.randn(16, 48)) is None
    assert quantize_blocks(torch.randn(20, 64)).shape == (20, 64)  # any number of rows


@pytest.mark.parametrize("kind", WEIGHTS)
def test_the_product_is_float32s_within_the_activations_8_bit_rounding(kind):
    w = quantize_blocks(WEIGHTS[kind]())
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(6))
    x[0, :BLOCK] = 0  # an all-zero block
    got = block_linear(x, w)
    exact = x @ w.dequantize().T
    # each activation moves by at most half its block's step, dx / 2 = max|x| / 254
    dx = x.reshape(9, -1, BLOCK).abs().amax(-1) / 127
    wabs = w.dequantize().abs().reshape(w.shape[0], -1, BLOCK).sum(-1)  # [N, nb]
    bound = (dx[:, None, :] / 2 * wabs[None]).sum(-1)  # [M, N]
    assert bool(((got - exact).abs() <= bound * 1.01 + 1e-5).all())
    assert (got - exact).abs().max() > 0  # the activations really are rounded


@pytest.mark.parametrize("kind", WEIGHTS)
def test_the_kernel_computes_what_its_reference_does(kind):
    if not blocks_cpu.load():
        pytest.skip(f"no block kernel here: {blocks_cpu.identity()}")
    w = quantize_blocks(WEIGHTS[kind]())
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(7)) * 3
    got, want = blocks_cpu.block_mm(x, w.qs, w.d, w.m), blocks_cpu.reference(x, w.qs, w.d, w.m)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("kind", WEIGHTS)
@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(kind, path, monkeypatch):
    if path == "kernel" and not blocks_cpu.load():
        pytest.skip(f"no block kernel here: {blocks_cpu.identity()}")
    if path == "reference":
        monkeypatch.setattr(blocks_cpu, "_op", None)
    w = quantize_blocks(WEIGHTS[kind]())
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(5))
    together = block_linear(x, w)
    assert together.dtype == torch.float32 and together.shape == (40, w.shape[0])
    for rows in (1, 2, 3, 7, 16, 33):
        assert torch.equal(block_linear(x[:rows], w), together[:rows])
        assert torch.equal(block_linear(x[-rows:], w), together[-rows:])
    assert torch.equal(block_linear(x.view(4, 10, 96), w).view(40, -1), together)
    assert block_linear(x[:0], w).shape == (0, w.shape[0])


@pytest.mark.parametrize("kind", WEIGHTS)
def test_two_activation_levels_are_closer_and_the_kernel_agrees(kind):
    w = quantize_blocks(WEIGHTS[kind]())
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(8))
    exact = x @ w.dequantize().T
    one, two = (blocks_cpu.reference(x, w.qs, w.d, w.m, levels) for levels in (1, 2))
    assert (two - exact).abs().max() < (one - exact).abs().max() / 50
    if blocks_cpu.load():
        got = blocks_cpu.block_mm(x, w.qs, w.d, w.m, 2)
        assert torch.allclose(got, two, rtol=1e-5, atol=1e-5 * float(two.abs().max()))
        for rows in (1, 2, 3, 5):  # the kernel's narrow loops below three rows, its wide ones from three
            assert torch.equal(blocks_cpu.block_mm(x[:rows], w.qs, w.d, w.m, 2), got[:rows])


def test_weights_are_packed_into_panels_where_the_cpu_has_avx512_vnni():
    assert blocks_cpu.packs() == HAS_VNNI, blocks_cpu.identity()
    w = quantize_blocks(q4_1_weight(40, 64))
    assert (w.panels is not None) == HAS_VNNI
    if HAS_VNNI:  # 3 panels of 16 rows (the last one 8 rows short), 2 blocks, 320 bytes a block
        assert w.panels.shape == (3, 2, 320) and w.panels.dtype == torch.uint8


@pytest.mark.parametrize("kind", ["q4_1", "float"])
@pytest.mark.parametrize("act_levels", [1, 2])
def test_the_panels_give_the_bits_of_the_avx2_loops(kind, act_levels):
    if not blocks_cpu.packs():
        pytest.skip(f"no AVX-512 VNNI panels here: {blocks_cpu.identity()}")
    g = torch.Generator().manual_seed(9)
    for n, k in ((37, 96), (64, 576), (20, 1536)):  # rows past the last whole panel; SmolLM2's widths
        w = quantize_blocks(q4_1_weight(n, k, seed=n) if kind == "q4_1" else torch.randn(n, k, generator=g))
        assert w.bits == (4 if kind == "q4_1" else 8) and w.panels is not None
        x = torch.randn(33, k, generator=g) * 3
        x[1, :BLOCK] = 0  # an all-zero block
        # the AVX2 kernel's narrow loops below three rows, wide from three; the panels' groups of 16,
        # then 8, then the rest (25: 16 + 8 + 1)
        for rows in (1, 2, 3, 4, 5, 9, 16, 25, 33):
            want = blocks_cpu.block_mm(x[:rows], w.qs, w.d, w.m, act_levels)
            assert torch.equal(blocks_cpu.block_mm(x[:rows], w.qs, w.d, w.m, act_levels, w.panels), want), (n, k, rows)
