"""GGUF-style block experts (shared/model/moe.py's ``BlockExperts``): each expert quantized as a dense
layer's ``quantize_blocks``, its routed rows multiplied by the block kernel; ``--quantization gguf`` and
the AVX-512 VNNI default on a mixture of experts."""

import logging

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.model.loader import load_model
from shared.model.moe import BlockExperts, block_experts
from shared.model.quant import BlockWeight, block_linear, quantize_blocks
from test_moe_int8 import PROMPT, block, per_expert_loop, rel_err
from tiny_hf_models import save_tiny


def test_block_experts_are_the_dense_quantization_per_expert():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3, 40, 64, generator=gen)
    q = block_experts(w)
    assert isinstance(q, BlockExperts) and q.shape == (3, 40, 64)
    for e in range(3):
        dense = quantize_blocks(w[e])
        assert isinstance(q[e], BlockWeight) and q[e].bits == 8
        assert torch.equal(q[e].qs, dense.qs) and torch.equal(q[e].d, dense.d)
    part = q[1:3]  # a range of experts, as expert parallelism would hold them
    assert isinstance(part, BlockExperts) and part.shape == (2, 40, 64) and part[0] is q[1]
    assert rel_err(q.dequantize(), w) < 0.01
    # int8 levels and a float16 scale per 32: about 0.27 of float32
    assert q.nbytes < 0.3 * w.numel() * 4
    on_grid = torch.randint(0, 16, (2, 8, 64), generator=gen).float() * 0.05 - 0.3  # a Q4 file's experts
    assert all(e.bits == 4 for e in block_experts(on_grid).weights)
    assert block_experts(torch.randn(2, 8, 40)) is None  # rows not whole blocks of 32


def test_block_experts_are_close_to_float_and_equal_to_a_loop_over_block_linear():
    """The output within 3% of the float experts'; bit for bit a per-expert loop through block_linear;
    the same through the grouped path (kernel auto) and the per-expert path (kernel torch); a token's
    rows the same whatever its batch-mates."""
    x = torch.randn(29, 64, generator=torch.Generator().manual_seed(1))
    moe, looped = block(), block(kernel="torch")
    want_float = moe.forward(x)
    gate_up = [quantize_blocks(w) for w in moe.gate_up]
    down = [quantize_blocks(w) for w in moe.down]
    assert moe.quantize_gguf() and looped.quantize_gguf()
    assert isinstance(moe.gate_up, BlockExperts) and isinstance(moe.down, BlockExperts)
    assert len(moe.route(x)[0].unique()) == 4  # every expert has tokens
    got = moe.forward(x)
    assert rel_err(got, want_float) < 0.03
    torch.testing.assert_close(got, per_expert_loop(moe, x, gate_up, down, linear=block_linear), rtol=0, atol=0)
    torch.testing.assert_close(looped.forward(x), got, rtol=0, atol=0)
    experts, weights = moe.route(x)
    for rows in (slice(3, 4), slice(5, 12)):
        alone = moe.forward_grouped(x[rows], experts[rows], weights[rows], moe.grouped_linear(x), count=False)
        assert torch.equal(alone, got[rows])


def test_experts_not_in_whole_blocks_stay_float():
    moe = block(hidden=48)  # gate_up's input, 48 wide, is not whole blocks of 32
    assert not moe.quantize_gguf()
    assert isinstance(moe.gate_up, torch.Tensor) and isinstance(moe.down, torch.Tensor)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "deepseek_v3"])
def tiny_moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, path, **WHOLE_BLOCKS.get(request.param, {}))
    return request.param, path


# the tiny DeepSeek's experts are 16 wide, which stay float under gguf (not whole blocks of 32)
WHOLE_BLOCKS = {"deepseek_v3": {"moe_intermediate_size": 32}}


# Top-1 agreement with the float model's logits over PROMPT (96 tokens), every linear layer and expert in
# 8-bit blocks: mixtral 0.896, qwen3_moe 0.875, deepseek_v3 0.906 (gpt-oss 0.833); the experts alone in
# blocks 0.938, 0.958, 0.979 (int8 experts: 0.927, 0.958, 0.948). The tiny random models' logits are flat,
# so near-ties flip
MIN_AGREEMENT = 0.85


def test_a_gguf_mixture_of_experts_serves_greedy_text(tiny_moe):
    kind, path = tiny_moe
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    want = model.prefill_logits(PROMPT)
    model.quantize("gguf")
    assert model.quantization == "gguf"
    moe_layers = [layer.moe for layer in model.layers if layer.moe is not None]
    assert moe_layers and all(isinstance(w, BlockExperts) for m in moe_layers for w in (m.gate_up, m.down))
    got = model.prefill_logits(PROMPT)
    agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    assert agreement >= MIN_AGREEMENT, (kind, agreement)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=24,
                                           quantization="gguf"))
    prompts = [[(5 * i + k) % 256 for i in range(n)] for k, n in ((1, 3), (2, 37), (3, 90))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert together == alone  # batch-mates do not change a request's tokens
    assert sum(1 for m in moe_layers for n in m.expert_tokens.tolist() if n) > 0  # the experts ran


def test_the_avx512_vnni_default_holds_experts_in_blocks(tiny_moe, smollm2_gguf, tmp_path, monkeypatch, caplog):
    """Where the CPU default is gguf (AVX-512 VNNI), a model with experts takes it too, experts included."""
    from loadtest.tools.synth_model import write_hf_tokenizer
    from shared.engine import config as engine_config
    from shared.engine.build import load_model as load_engine_model
    from shared.model.precision import AVX512_VNNI_FLAGS

    monkeypatch.setattr(engine_config, "cpu_flags", lambda: frozenset(AVX512_VNNI_FLAGS))
    save_tiny(tiny_moe[0], tmp_path, vocab_size=49152, **WHOLE_BLOCKS.get(tiny_moe[0], {}))
    write_hf_tokenizer(tmp_path, smollm2_gguf)
    with caplog.at_level(logging.INFO, logger="shared.engine.build"):
        loaded = load_engine_model(EngineConfig(model=str(tmp_path), device="cpu"))
    assert (loaded.config.dtype, loaded.config.quantization) == ("float32", "gguf")
    experts = [layer.moe for layer in loaded.model.layers if layer.moe is not None]
    assert experts and all(isinstance(moe.gate_up, BlockExperts) for moe in experts)
    assert "avx512_vnni" in caplog.text
