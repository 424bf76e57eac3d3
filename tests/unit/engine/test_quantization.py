"""Int8 (W8A8) linear layers: accuracy of the op, smoothing, batch independence, and the engine
running a quantized tiny model."""

import pytest
import torch
import torch.nn.functional as F

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.model.loader import load_model
from shared.model.quant import (Int8Weight, check_quantization, int8_linear, linear, observe,
                                quantize_int8, quantize_rows)


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def test_int8_linear_is_close_to_float():
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(5, 3, 64)
    q = quantize_int8(w)
    assert isinstance(q, Int8Weight) and q.qweight.dtype == torch.int8 and q.shape == (96, 64)
    assert rel_err(q.dequantize(), w) < 0.01
    out = linear(x, q, b)
    assert out.shape == (5, 3, 96) and out.dtype == torch.float32
    assert rel_err(out, F.linear(x, w, b)) < 0.02
    assert linear(x[:0], q).shape == (0, 3, 96)


def test_rows_are_independent_of_their_batch_mates():
    """int32 accumulation is exact and each token has its own scale: a row's output is bitwise the
    same alone or in any batch (as a request's tokens must not depend on who else is running)."""
    torch.manual_seed(1)
    q = quantize_int8(torch.randn(128, 64))
    x = torch.randn(37, 64)
    x[5] *= 1000  # an outlier token does not change anybody else's scale
    together = int8_linear(x, q)
    for i in (0, 6, 36):
        assert torch.equal(int8_linear(x[i:i + 1], q)[0], together[i])


def test_one_level_activations_use_the_rows_own_range():
    """A row leaning to one side (SiLU's output stops at -0.28) is cut into 255 steps over
    [min(x, 0), max(x, 0)], not over [-max|x|, max|x|]: about half the rounding error, zero exact."""
    torch.manual_seed(3)
    x = F.silu(torch.randn(64, 512) * 3)
    x[1] = x[1].abs() + 0.5  # all positive
    x[2] = -x[2].abs()  # all negative
    x[3] = 0.0
    x[4, 0] = 0.0
    q, scale, zero = quantize_rows(x)
    assert q.dtype == torch.int8 and zero.dtype == torch.int32 and scale.shape == zero.shape == (64, 1)
    assert int(zero.min()) >= -128 and int(zero.max()) <= 127
    back = (q.float() - zero) * scale
    assert torch.equal(back[3], x[3]) and back[4, 0] == 0.0  # zero stays exact
    assert torch.all(back[2] <= 0) and torch.all(back[1] >= 0)
    sym_scale = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    symmetric = torch.round(x / sym_scale).clamp(-127, 127) * sym_scale
    assert rel_err(back, x) < 0.7 * rel_err(symmetric, x), (rel_err(back, x), rel_err(symmetric, x))


def test_the_zero_point_correction_is_exact():
    """int8_linear's int32 sums less zero * row_sum(w) are the exact product of the dequantized
    operands: float64 agrees to float32's rounding, whatever the zero points."""
    torch.manual_seed(4)
    w = quantize_int8(torch.randn(200, 1536))
    x = F.silu(torch.randn(9, 1536) * 4) + torch.linspace(-1, 3, 9)[:, None]
    q, scale, zero = quantize_rows(x)
    exact = ((q.double() - zero.double()) * scale.double()) @ (w.qweight.double() * w.scale.double()[:, None]).T
    assert rel_err(int8_linear(x, w).double(), exact) < 1e-6
    assert rel_err(int8_linear(x, w), F.linear(x, w.dequantize())) < 0.02


def test_smoothing_tames_outlier_channels():
    torch.manual_seed(2)
    w = torch.randn(64, 96) * 0.05
    x = torch.randn(200, 96)
    x[:, [3, 40]] *= 60  # a few activation channels far larger than the rest, as in LLMs
    obs = observe(w)
    ref = linear(x, obs)  # float compute while recording
    assert torch.allclose(ref, F.linear(x, w))
    assert torch.allclose(obs.act_amax, x.abs().amax(0))
    plain = rel_err(int8_linear(x, quantize_int8(w)), ref)
    smooth = quantize_int8(w, obs.act_amax)
    assert smooth.inv_smooth is not None and rel_err(smooth.dequantize(), w) < 0.05
    smoothed = rel_err(int8_linear(x, smooth), ref)
    assert smoothed < plain / 2, (smoothed, plain)


def test_quantization_names_are_checked():
    assert check_quantization("INT8", torch.device("cpu")) == "int8"
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        check_quantization("int4", torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("int8", torch.device("cuda"))
    with pytest.raises(ValueError, match="choose none, int8"):
        EngineConfig(quantization="fp4")


def test_engine_runs_a_quantized_model(tiny_hf):
    _, path, _ = tiny_hf
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="call model.quantize"):
        LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, quantization="int8"))
    prompts = [[(5 * i + k) % 256 for i in range(n)] for k, n in ((1, 3), (2, 37), (3, 90))]
    want = model.prefill_logits(prompts[2])
    model.quantize("int8", calibration_ids=[(3 * i) % 256 for i in range(64)])
    assert model.quantization == "int8"
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=24,
                                           quantization="int8"))
    got = model.prefill_logits(prompts[2])
    assert rel_err(got, want) < 0.1  # random weights: close to the float model, not equal
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert together == alone  # batch-mates do not change a request's tokens
    assert engine.kv.pool.num_free_blocks == engine.num_blocks


def test_a_residual_weight_counts_and_dequantizes_both_levels():
    torch.manual_seed(3)
    w = torch.randn(48, 64)
    one, two = quantize_int8(w), quantize_int8(w, residual=True)
    assert one.nbytes == 48 * 64 + 48 * 4 and two.nbytes == 2 * one.nbytes
    assert rel_err(two.dequantize(), w) < rel_err(one.dequantize(), w) / 50
