"""Weight-only blocks of 32 (``--quantization gguf``): a weight already on a 4-bit grid in every block,
as a GGUF file's Q4 layers are, is kept on that grid; any other weight gets symmetric 8-bit blocks
split into two 4-bit halves; the kernel gives a row the same bits alone and in any batch."""

from __future__ import annotations

import pytest
import torch

from shared.model.quant import BLOCK, BlockWeight, block_linear, four_bit_grid, quantize_blocks


def q4_1_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight as ggml's Q4_1 dequantizes: per block of 32, float16 d and m, w = d * q + m."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // BLOCK, generator=g) * 0.01 + 0.001).half().float()
    m = (-torch.rand(n, k // BLOCK, generator=g) * 0.08).half().float()
    q = torch.randint(0, 16, (n, k // BLOCK, BLOCK), generator=g).float()
    return (q * d[..., None] + m[..., None]).reshape(n, k)


def reference(w: BlockWeight, q: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel's weights are in float32, from its bfloat16 scales and offsets."""
    sz = w.scales_zeros.float().transpose(0, 1)  # [N, groups, 2]
    scale, zero = sz[..., 0].repeat_interleave(BLOCK, 1), sz[..., 1].repeat_interleave(BLOCK, 1)
    return (q - 8) * scale + zero


def test_a_q4_weight_keeps_its_own_levels():
    w = q4_1_weight(64, 128)
    q, step, lo = four_bit_grid(w)
    assert q.min() >= 0 and q.max() <= 15
    rebuilt = q.reshape(64, -1, BLOCK) * step[..., None] + lo[..., None]
    assert torch.allclose(rebuilt.reshape(64, 128), w, rtol=0, atol=1e-6)
    b = quantize_blocks(w)
    assert b.bits == 4 and b.shape == (64, 128)
    # only the block scales and offsets move, by bfloat16's rounding (8 bits): at most 2^-9 of the
    # offset lo + 8 step and 8 times 2^-9 of the step
    err = (reference(b, q.float()) - w).abs().reshape(64, -1, BLOCK).amax(-1)
    assert bool((err <= (8 * step + (lo + 8 * step).abs()) * 2 ** -8).all())
    assert bool((err < step / 4).all())


def test_a_block_that_is_constant_or_a_q4_0_block_fits_the_grid():
    w = q4_1_weight(16, 64)
    w[0, :BLOCK] = 0.25  # one value in the whole block
    g = torch.Generator().manual_seed(1)
    d = 0.02
    w[1, :BLOCK] = d * (torch.randint(3, 12, (BLOCK,), generator=g).float() - 8)  # Q4_0, levels 3..11 only
    w[1, 0], w[1, 1] = d * -5, d * -4  # two neighbouring levels: the step is found
    assert quantize_blocks(w).bits == 4
    assert torch.allclose(quantize_blocks(w).dequantize()[0, :BLOCK], w[0, :BLOCK])


def test_a_float_weight_gets_8_bit_blocks_whose_halves_add_up():
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(2)) * 0.05
    assert four_bit_grid(w) is None
    b = quantize_blocks(w)
    assert b.bits == 8 and b.packed.shape == (32, 96)  # two 4-bit halves side by side: 2K / 2 bytes
    s8 = w.reshape(32, -1, BLOCK).abs().amax(-1) / 127
    err = (b.dequantize() - w).abs().reshape(32, -1, BLOCK).amax(-1)
    # half an 8-bit step of rounding, the scale's bfloat16 rounding, and the bfloat16 of the output
    assert bool((err <= s8 * 0.5 + w.abs().reshape(32, -1, BLOCK).amax(-1) * 2 ** -7).all())


def test_shapes_the_kernel_cannot_take_stay_float():
    assert quantize_blocks(torch.randn(20, 64)) is None  # N not a multiple of 16
    assert quantize_blocks(torch.randn(16, 48)) is None  # K not a multiple of 32


@pytest.mark.parametrize("make", [lambda: q4_1_weight(48, 96, seed=3),
                                  lambda: torch.randn(48, 96, generator=torch.Generator().manual_seed(4))])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(make):
    w = quantize_blocks(make())
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(5))
    together = block_linear(x, w)
    assert together.dtype == torch.float32 and together.shape == (40, 48)
    for rows in (1, 2, 7, 16, 33):
        assert torch.equal(block_linear(x[:rows], w), together[:rows])
    assert torch.equal(block_linear(x.view(4, 10, 96), w).view(40, 48), together)
    assert block_linear(x[:0], w).shape == (0, 48)
    # against float32 with the same weights: bfloat16 activations and output, a few parts in a thousand
    exact = x @ w.dequantize().T
    assert (together - exact).abs().max() <= 2e-2 * exact.abs().max()
