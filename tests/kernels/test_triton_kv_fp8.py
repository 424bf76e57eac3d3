"""FP8 e4m3 quantize / dequantize with per-block scales: Triton against the torch reference, bit
for bit, and the reference against the e4m3 error bound."""

import pytest
import torch

from kernels.kv_fp8 import FP8_DTYPE, FP8_MAX, dequantize_kv_fp8_ref, quantize_kv_fp8_ref
from kernels.kv_fp8_triton import dequantize_kv_fp8_triton, quantize_kv_fp8_triton


def _blocks(num_blocks, block_size, dtype, device, seed=0):
    """A pool-row slab [n, L=2, 2, bs, Hkv=2, D=64]; each block has its own magnitude (one all zero,
    one tiny enough for e4m3 subnormals after scaling, one with a large outlier)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_blocks, 2, 2, block_size, 2, 64, generator=gen)
    magnitudes = torch.tensor([1.0, 300.0, 1e-3, 0.0, 5.0, 0.02])[:num_blocks]
    x = x * magnitudes.view(-1, 1, 1, 1, 1, 1)
    x[1, 0, 1, 0, 0, 0] = 3e4
    return x.to(dtype=dtype, device=device)


def _assert_fp8_equal(a, b):
    assert a.dtype == b.dtype == FP8_DTYPE
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("block_size,dtype,per_layer", [
    (16, torch.float32, False),
    (32, torch.bfloat16, True),
    (128, torch.bfloat16, False),
])
def test_quantize_dequantize_match_reference(device, block_size, dtype, per_layer):
    x = _blocks(6 if block_size < 128 else 3, block_size, dtype, device)
    groups = x.flatten(0, 2) if per_layer else x  # one scale per (block, layer, K/V) or per block
    q, scales = quantize_kv_fp8_triton(groups)
    q_ref, scales_ref = quantize_kv_fp8_ref(groups)
    assert scales.shape == (groups.shape[0],) and scales.dtype == torch.float32
    assert torch.equal(scales, scales_ref)
    _assert_fp8_equal(q, q_ref)
    for out_dtype in (torch.float32, torch.bfloat16):
        out = dequantize_kv_fp8_triton(q, scales, out_dtype)
        assert out.dtype == out_dtype and out.shape == groups.shape
        assert torch.equal(out, dequantize_kv_fp8_ref(q_ref, scales_ref, out_dtype))


def test_quantize_strided_layer_view(device):
    """A per-layer cache view (row stride covers all layers) quantizes like its contiguous copy."""
    pool = _blocks(4, 16, torch.bfloat16, device)
    k_cache = pool[:, 1, 0]  # [N, bs, Hkv, D], not contiguous
    q, scales = quantize_kv_fp8_triton(k_cache)
    q_ref, scales_ref = quantize_kv_fp8_ref(k_cache.contiguous())
    assert torch.equal(scales, scales_ref)
    _assert_fp8_equal(q, q_ref)


def test_every_e4m3_value_and_midpoint_rounds_like_torch(device):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE)
    values = codes.float()
    values = values[~values.isnan()].sort().values  # -448 .. 448, with -0.0 and 0.0
    midpoints = (values[1:] + values[:-1]) / 2  # exact in float32: ties, rounded to even
    nudged = torch.cat([midpoints * (1 + 2**-20), midpoints * (1 - 2**-20)])
    # one group whose amax is 448 gives scale 1: the kernel sees the values unscaled
    x = torch.cat([values, midpoints, nudged]).view(1, -1).to(device)
    q, scales = quantize_kv_fp8_triton(x)
    q_ref, _ = quantize_kv_fp8_ref(x)
    assert float(scales[0]) == 1.0
    _assert_fp8_equal(q, q_ref)
    decoded = dequantize_kv_fp8_triton(q[:, :values.numel()], scales, torch.float32)
    assert torch.equal(decoded.cpu()[0], values)


def test_reference_error_is_within_e4m3_half_ulp(device):
    x = _blocks(6, 16, torch.float32, device).flatten(0, 2)
    q, scales = quantize_kv_fp8_ref(x)
    back = dequantize_kv_fp8_ref(q, scales, torch.float32)
    s = scales.view(-1, *[1] * (x.dim() - 1))
    # 3 mantissa bits: half an ulp is 2**-4 relative; below 2**-6 (subnormal) the step is 2**-9
    bound = torch.maximum(x.abs() * 2**-4, s * 2**-10) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()
    assert (x.abs().flatten(1).amax(1) <= scales * FP8_MAX * (1 + 1e-6)).all()


def test_device_dispatch_uses_the_reference_off_cuda():
    from kernels.kv_fp8 import dequantize_kv_fp8, quantize_kv_fp8

    x = _blocks(2, 16, torch.bfloat16, "cpu")
    q, scales = quantize_kv_fp8(x)
    q_ref, scales_ref = quantize_kv_fp8_ref(x)
    _assert_fp8_equal(q, q_ref)
    assert torch.equal(dequantize_kv_fp8(q, scales, torch.bfloat16),
                       dequantize_kv_fp8_ref(q_ref, scales_ref, torch.bfloat16))
