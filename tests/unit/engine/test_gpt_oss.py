"""gpt-oss against transformers on a tiny random-weight model: attention sinks, windowed layers beside a
global one, q/k/v/o biases, YaRN, and experts with biases, a clamped SwiGLU and a softmax over the top k."""

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.model.config import ModelConfig, YarnScaling
from shared.model.loader import load_model
from tiny_hf_models import SLIDING_WINDOW, save_tiny

PROMPT = [(13 * i + 5) % 256 for i in range(96)]  # eight times the tiny model's window


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = save_tiny("gpt_oss", path)
    return path, hf


def load(path):
    return load_model(path, "hf", torch.device("cpu"), torch.float32)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_config_is_read_as_transformers_reads_it(gpt_oss, caplog):
    import logging

    path, hf = gpt_oss
    with caplog.at_level(logging.INFO, logger="shared.model.llama"):
        cfg = load(path).cfg
    assert "gpt_oss: attention sinks: every layer attends in torch" in caplog.text
    assert cfg.attention_sinks and cfg.attention_bias
    assert (cfg.sliding_window, cfg.window_layers, cfg.uniform_window) == (SLIDING_WINDOW, (0, 2), None)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size, cfg.moe.layers) == (8, 2, 32, (0, 1, 2))
    assert cfg.moe.softmax_after_topk and cfg.moe.clamped_swiglu.limit == 1.5 and cfg.moe.clamped_swiglu.alpha == 1.702
    assert cfg.rope_scaling == YarnScaling(factor=8.0, original_max_position_embeddings=64, truncate=False)
    for layer, hf_layer in zip(load(path).layers, hf.model.layers):  # sinks nonzero, as the test needs them
        assert torch.equal(layer.sinks, hf_layer.self_attn.sinks.detach()) and layer.sinks.abs().min() > 0


def test_yarn_frequencies_and_attention_factor_match_transformers(gpt_oss):
    from shared.model.llama import rope_attention_factor, rope_inv_freq

    path, hf = gpt_oss
    cfg = load(path).cfg
    rotary = hf.model.rotary_emb
    torch.testing.assert_close(rope_inv_freq(cfg), rotary.inv_freq, rtol=1e-6, atol=0)
    assert rope_attention_factor(cfg) == pytest.approx(rotary.attention_scaling) and rotary.attention_scaling > 1


def test_logits_at_every_position_match(gpt_oss):
    path, hf = gpt_oss
    torch.testing.assert_close(load(path).prefill_logits(PROMPT), hf_logits(hf, PROMPT), rtol=1e-4, atol=1e-4)


def test_ignoring_the_sinks_moves_the_logits(gpt_oss):
    """The test above fails without the sinks: the logits without them are far from transformers'."""
    path, hf = gpt_oss
    model = load(path)
    for layer in model.layers:
        layer.sinks = None
    assert (model.prefill_logits(PROMPT) - hf_logits(hf, PROMPT)).abs().max() > 0.05


def test_greedy_through_the_engine_is_transformers_generate(gpt_oss):
    """Chunked prefill beside decodes over a paged cache of 8-token blocks: each prompt's 16 greedy
    tokens are transformers' generate's."""
    path, hf = gpt_oss
    engine = LLMEngine(load(path), EngineConfig(kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=24))
    prompts = [PROMPT[:n] for n in (5, 40, 70)]
    got = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, generated in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert generated == want[0, len(prompt):].tolist()
    assert engine.kv.pool.num_free_blocks == engine.num_blocks


def test_sinks_far_below_the_scores_give_the_backends_attention():
    """Decode rows and prefill chunks of one step: a sink of -1e4 takes no share of any softmax, so
    ``gathered_attention`` is plain attention; a sink of 0 takes a share and shrinks every output."""
    from shared.model.attention import AttentionMetadata, TorchAttentionBackend, gathered_attention

    gen = torch.Generator().manual_seed(0)
    bs, kv_heads, heads, d = 4, 2, 4, 16
    k_cache, v_cache = torch.randn(12, bs, kv_heads, d, generator=gen), torch.randn(12, bs, kv_heads, d, generator=gen)
    seq_lens, q_lens = [7, 3, 10, 5], [1, 1, 4, 5]  # two decode rows, then two prefill chunks
    tables = torch.tensor([[0, 1, 0], [2, 0, 0], [3, 4, 5], [6, 7, 0]], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, d, generator=gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(num_decodes=2, slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long),
                             block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             query_start_loc=starts, max_seq_len=10, max_query_len=5)
    for window in (None, 3):
        want = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, 0.25, window)
        got = gathered_attention(q, k_cache, v_cache, meta, 0.25, window, sinks=torch.full((heads,), -1e4))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        sunk = gathered_attention(q, k_cache, v_cache, meta, 0.25, window, sinks=torch.zeros(heads))
        assert (sunk.norm(dim=-1) < want.norm(dim=-1)).all()


BASE = dict(model_type="gpt_oss", vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
            sliding_window=128, max_position_embeddings=131072,
            rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0})


def test_a_hub_config_without_layer_types_windows_every_other_layer_from_the_first():
    cfg = ModelConfig.from_hf(BASE)
    assert cfg.window_layers == (0, 2) and cfg.rope_theta == 150000.0 and cfg.rope_scaling.factor == 32.0
    assert cfg.moe.clamped_swiglu.limit == 7.0 and cfg.attention_bias


def test_mxfp4_checkpoints_and_gguf_files_are_refused_by_name(tmp_path):
    import json

    from shared.model.loader import gguf_family

    (tmp_path / "config.json").write_text(json.dumps(BASE | {"quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ValueError, match="unsupported quantized checkpoint of gpt_oss \\(quant_method 'mxfp4'\\)"):
        load(tmp_path)

    class GptOssGguf:  # llama.cpp's converter's architecture name; its experts are MXFP4
        tensors = ()

        def get(self, key, default=None):
            return "gpt-oss" if key == "general.architecture" else default

    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt-oss'"):
        gguf_family(GptOssGguf())


def test_experts_biases_and_clamped_swiglu_agree_on_every_path():
    """gpt-oss's block through the eager loop, every expert over every token (a CUDA graph's capture)
    and the grouped-GEMM path (its torch reference here), which adds the biases around the kernel."""
    import torch.nn.functional as F

    from kernels.moe_grouped import grouped_linear_ref
    from shared.model.config import ClampedSwiglu, Moe
    from shared.model.moe import ExpertBiases, MoeBlock

    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, width = 4, 8, 6
    moe = Moe(num_experts=num_experts, top_k=2, intermediate_size=width, renormalize=False, round_weights=True,
              layers=(0,), softmax_after_topk=True, clamped_swiglu=ClampedSwiglu(1.702, 1.0))
    biases = ExpertBiases(*(torch.randn(*shape, generator=gen) for shape in
                            ((num_experts,), (num_experts, 2 * width), (num_experts, hidden))))
    block = MoeBlock(moe, torch.randn(num_experts, hidden, generator=gen),
                     torch.randn(num_experts, 2 * width, hidden, generator=gen),
                     torch.randn(num_experts, hidden, width, generator=gen), F.silu, biases=biases)
    x = torch.randn(13, hidden, generator=gen)
    experts, weights = block.route(x)
    assert len(experts.unique()) == num_experts
    torch.testing.assert_close(weights.sum(-1), torch.ones(13))
    eager = block.forward(x)
    torch.testing.assert_close(block.forward_every_expert(x, experts, weights), eager, rtol=1e-5, atol=1e-5)
    grouped = block.forward_grouped(x, experts, weights, grouped_linear_ref, count=False)
    torch.testing.assert_close(grouped, eager, rtol=1e-5, atol=1e-5)
    block.biases = ExpertBiases(router=biases.router)  # and the experts' biases do count
    assert (block.forward(x) - eager).abs().max() > 0.1


def test_tensor_parallel_is_refused_by_name(gpt_oss):
    """Its sinks (per head) and biases are not cut between ranks yet: refused before a rank builds."""
    from shared.model.parallel import SingleRank

    class TwoRanks(SingleRank):
        size = 2

    path, _ = gpt_oss
    with pytest.raises(ValueError, match="tensor parallel gpt_oss is not built yet"):
        load_model(path, "hf", torch.device("cpu"), torch.float32, TwoRanks())


def test_it_decodes_eagerly_under_compile(tmp_path, caplog):
    from test_compiled_decode import test_families_the_compiled_step_does_not_cover_decode_eagerly as check

    check(tmp_path, "gpt_oss", "a mixture of experts", caplog)
