"""Int8 experts (shared/model/moe.py's ``Int8Experts``): each expert quantized as a dense int8 layer,
its routed rows multiplied by quant.py's ``int8_linear``; a tiny mixture of experts served at int8."""

import pytest
import torch
import torch.nn.functional as F

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.model.config import Moe
from shared.model.loader import load_model
from shared.model.moe import Int8Experts, MoeBlock, quantize_experts
from shared.model.quant import int8_linear, quantize_int8
from tiny_hf_models import save_tiny


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def block(num_experts: int = 4, hidden: int = 64, width: int = 32, kernel: str = "auto") -> MoeBlock:
    gen = torch.Generator().manual_seed(0)
    moe = Moe(num_experts=num_experts, top_k=2, intermediate_size=width, renormalize=True,
              round_weights=False, layers=(0,))
    return MoeBlock(moe, torch.randn(num_experts, hidden, generator=gen),
                    torch.randn(num_experts, 2 * width, hidden, generator=gen) * 0.2,
                    torch.randn(num_experts, hidden, width, generator=gen) * 0.2, F.silu, kernel=kernel)


def per_expert_loop(moe: MoeBlock, x: torch.Tensor, gate_up: list, down: list, linear=int8_linear):
    """The block written out: each expert's tokens (in token order) through ``linear`` with its
    weights, weighted and added up in float32 expert by expert."""
    experts, weights = moe.route(x)
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in range(len(gate_up)):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if len(token):
            g, u = linear(x[token], gate_up[e]).chunk(2, dim=-1)
            y = linear(F.silu(g) * u, down[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).float())
    return out.to(x.dtype)


def test_int8_experts_are_the_dense_quantization_stacked():
    w = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(2))
    q = quantize_experts(w)
    assert q.qweight.dtype == torch.int8 and q.shape == (3, 40, 24) and q.scale.shape == (3, 40)
    for e in range(3):
        dense = quantize_int8(w[e])
        assert torch.equal(q[e].qweight, dense.qweight) and torch.equal(q[e].scale, dense.scale)
        assert torch.equal(q[e].qsums, dense.qsums)
        assert q[e].qweight.data_ptr() == q.qweight[e].data_ptr()  # a view of the stack, not a copy
    part = q[1:3]  # a range of experts, as expert parallelism would hold them
    assert isinstance(part, Int8Experts) and part.shape == (2, 40, 24) and torch.equal(part[0].qweight, q[1].qweight)
    assert rel_err(q.dequantize(), w) < 0.01


def test_int8_experts_are_close_to_float_and_equal_to_a_loop_over_int8_linear():
    """Random input: the output within 3% (relative L2 error) of the float experts'; equal, bit for
    bit, to a per-expert loop through int8_linear with each expert quantized on its own; the same
    through the grouped path (kernel auto) and the per-expert torch path (kernel torch)."""
    x = torch.randn(29, 64, generator=torch.Generator().manual_seed(1))
    moe, looped = block(), block(kernel="torch")
    want_float = moe.forward(x)
    gate_up = [quantize_int8(w) for w in moe.gate_up]
    down = [quantize_int8(w) for w in moe.down]
    moe.quantize_int8()
    looped.quantize_int8()
    assert isinstance(moe.gate_up, Int8Experts) and isinstance(moe.down, Int8Experts)
    assert len(moe.route(x)[0].unique()) == 4  # every expert has tokens
    got = moe.forward(x)
    err = rel_err(got, want_float)
    assert err < 0.03, err
    torch.testing.assert_close(got, per_expert_loop(moe, x, gate_up, down), rtol=0, atol=0)
    torch.testing.assert_close(looped.forward(x), got, rtol=0, atol=0)
    # routed alike, a token's output does not depend on its batch-mates (per-row activation scales,
    # exact int32 sums); the float router's product alone may round differently at another batch size
    experts, weights = moe.route(x)
    for rows in (slice(3, 4), slice(5, 12)):
        alone = moe.forward_grouped(x[rows], experts[rows], weights[rows], moe.grouped_linear(x), count=False)
        assert torch.equal(alone, got[rows])


def test_two_activation_levels_bring_int8_experts_closer():
    """``int8-precise``'s experts: the activations in two int8 levels (here 0.94% from float
    instead of 1.31%; what is left is the weights' rounding, the same in both)."""
    x = torch.randn(29, 64, generator=torch.Generator().manual_seed(1))
    one, two = block(), block()
    want = one.forward(x)
    one.quantize_int8()
    two.quantize_int8(act_levels=2)
    assert two.gate_up[0].act_levels == 2
    assert rel_err(two.forward(x), want) < 0.8 * rel_err(one.forward(x), want)


def test_float_experts_keep_their_path():
    """Float experts on the CPU: the torch loop of F.linear over each expert's rows, bit for bit."""
    x = torch.randn(17, 64, generator=torch.Generator().manual_seed(3))
    moe = block()
    assert moe.grouped_linear(x) is None
    want = per_expert_loop(moe, x, list(moe.gate_up), list(moe.down), linear=F.linear)
    assert torch.equal(moe.forward(x), want)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def tiny_moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, path)
    return request.param, path


def expert_bytes(model) -> int:
    return sum(w.nbytes if isinstance(w, Int8Experts) else w.numel() * w.element_size()
               for layer in model.layers if layer.moe is not None for w in (layer.moe.gate_up, layer.moe.down))


# Top-1 agreement with the float model's logits over PROMPT (96 tokens), every linear layer and
# expert in int8: mixtral 0.885, qwen3_moe 0.938 (gpt-oss 0.833); the dense layers alone in int8
# give 0.875, 0.917, 0.833 and the experts alone 0.927, 0.958, 0.948. The tiny random models' logits
# are flat, so near-ties flip: the experts cost less agreement than the dense layers do.
MIN_AGREEMENT = 0.8
MIN_EXPERTS_AGREEMENT = 0.9
PROMPT = [(13 * i + 5) % 256 for i in range(96)]


def test_an_int8_mixture_of_experts_serves_greedy_text(tiny_moe):
    kind, path = tiny_moe
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    want = model.prefill_logits(PROMPT)
    float_bytes = expert_bytes(model)
    model.quantize("int8", calibration_ids=[(3 * i) % 256 for i in range(64)])
    assert model.quantization == "int8"
    moe_layers = [layer.moe for layer in model.layers if layer.moe is not None]
    assert moe_layers and all(isinstance(w, Int8Experts) and w.qweight.dtype == torch.int8
                              for m in moe_layers for w in (m.gate_up, m.down))
    # int8 weights and a float32 scale per row: a little over a quarter of the float32 experts
    assert expert_bytes(model) < 0.3 * float_bytes, (expert_bytes(model), float_bytes)
    got = model.prefill_logits(PROMPT)
    agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    assert agreement >= MIN_AGREEMENT, (kind, agreement)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=24,
                                           quantization="int8"))
    prompts = [[(5 * i + k) % 256 for i in range(n)] for k, n in ((1, 3), (2, 37), (3, 90))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert together == alone  # batch-mates do not change a request's tokens
    assert engine.kv.pool.num_free_blocks == engine.num_blocks


def test_gpt_oss_experts_with_biases_take_int8(tmp_path):
    """gpt-oss's experts carry biases and a clamped SwiGLU around the int8 products: its experts
    alone in int8 keep the float model's top token."""
    save_tiny("gpt_oss", tmp_path)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32)
    want = model.prefill_logits(PROMPT)
    for layer in model.layers:
        layer.moe.quantize_int8()
    got = model.prefill_logits(PROMPT)
    agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    assert agreement >= MIN_EXPERTS_AGREEMENT, agreement
