"""loadtest.bench.activation_schemes: its simulated roundings are what they claim to be, the
asymmetric one agrees with the engine's exact int8 path, and the real product comes back after."""

import torch
import torch.nn.functional as F

from loadtest.bench.activation_schemes import (_grid_asym, _grid_blocks, _grid_outliers, _grid_sym,
                                               _grid_two_levels, simulated)
from shared.model import quant
from shared.model.quant import int8_linear, quantize_int8


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def test_the_grids_rank_as_their_precision_says():
    torch.manual_seed(0)
    x = F.silu(torch.randn(32, 256) * 3)
    x[:, 7] *= 40  # an outlier channel
    errs = {name: rel_err(grid(x), x) for name, grid in
            [("sym", _grid_sym), ("asym", _grid_asym), ("blocks", _grid_blocks(64)), ("two", _grid_two_levels)]}
    assert errs["two"] < errs["blocks"] < errs["sym"], errs
    assert errs["asym"] < errs["sym"], errs
    assert torch.equal(_grid_asym(torch.zeros(2, 8)), torch.zeros(2, 8))
    w = quantize_int8(torch.randn(16, 256))
    outliers = _grid_outliers({id(w): torch.tensor([7])})(x, w)
    assert rel_err(outliers, x) < errs["asym"] / 2
    assert torch.equal(outliers[:, 7], _grid_asym(x[:, 7:8])[:, 0])


def test_the_asymmetric_simulation_is_the_engines_int8():
    torch.manual_seed(1)
    w = quantize_int8(torch.randn(96, 192), act_amax=torch.rand(192) * 5)
    x = F.silu(torch.randn(6, 192) * 2)
    real = int8_linear(x, w)
    with simulated(_grid_asym):
        assert quant.int8_linear is not int8_linear
        simulated_out = quant.linear(x, w)
        assert not torch.equal(quant.linear(x, w), F.linear(x, w.dequantize()))
    assert quant.int8_linear is int8_linear
    assert rel_err(simulated_out, real) < 1e-4
    with simulated(_grid_sym):
        assert rel_err(quant.linear(x, w), real) > 1e-3  # a different rounding is seen as one


def test_precise_layers_variants_put_second_levels_where_they_say(tiny_hf):
    import pytest

    from loadtest.bench.precise_layers import VARIANTS, apply_variant
    from shared.model.loader import load_model

    _, path, _ = tiny_hf
    reference = load_model(path, "hf", torch.device("cpu"), torch.float32)
    ids = [(7 * i) % 256 for i in range(48)]
    want = reference.prefill_logits(ids)
    errors = {}
    for name in ("int8", "down a2 + head w2a2", "all a2 + head w2a2", "head float"):
        model = load_model(path, "hf", torch.device("cpu"), torch.float32)
        model.quantize("int8", calibration_ids=ids)
        apply_variant(model, reference, *VARIANTS[name])
        projections, head = VARIANTS[name]
        for layer in model.layers:
            assert {n: getattr(layer, n).act_levels for n in ("qkv", "o_proj", "gate_up", "down")} == \
                {n: 2 if n in projections else 1 for n in ("qkv", "o_proj", "gate_up", "down")}
        assert (model.lm_head is reference.lm_head) == (head == "float")
        errors[name] = rel_err(model.prefill_logits(ids), want)
    # second levels bring the logits closer to float32's
    assert errors["all a2 + head w2a2"] < errors["down a2 + head w2a2"] < errors["int8"], errors
    with pytest.raises(ValueError, match="unknown projections"):
        apply_variant(model, reference, ("mlp",), "int8")
