"""bench.linear's formats compute the same product: each within its quantization error of float32."""

import torch

from loadtest.bench.linear import INT4_GROUP, formats, time_call


def test_every_format_computes_x_times_w_transposed():
    torch.manual_seed(0)
    w, x = torch.randn(96, 4 * INT4_GROUP), torch.randn(3, 4 * INT4_GROUP)
    want = x @ w.t()
    bounds = {"float32": 1e-5, "w8a8": 0.03, "w8a8-precise": 0.03, "w8-bf16": 0.03, "int4": 0.12}
    errors = {}
    for name, fn in formats(w, x).items():
        got = fn().float()
        assert got.shape == want.shape, name
        errors[name] = float((got - want).abs().max() / want.abs().max())
        assert errors[name] < bounds[name], name
    # two activation levels leave the weight's rounding alone; two weight levels too, the LM head's way
    assert errors["w8a8-precise"] < errors["w8a8"]
    head_like = formats(w, x, residual_weight=True)["w8a8-precise"]().float()
    assert (head_like - want).abs().max() / want.abs().max() < 1e-3


def test_time_call_returns_a_positive_median():
    assert 0 < time_call(lambda: sum(range(100)), min_s=0.01) < 0.01
