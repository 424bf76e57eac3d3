"""gpt-oss against transformers on a tiny random-weight model: attention sinks, windowed layers beside a
global one, q/k/v/o biases, YaRN, and experts with biases, a clamped SwiGLU and a softmax over the top k;
and split over tensor-parallel ranks and pipeline stages, against the whole model."""

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


FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_encode(w: torch.Tensor):
    """A float export's expert weight [E, in, out] as the hub's checkpoints store it in MXFP4: blocks uint8
    [E, out, in / 32, 16] (two E2M1 codes a byte, the low nibble first), scales uint8 [E, out, in / 32]
    (a power of two biased by 127); and the weight those decode to, [E, in, out] (on the MXFP4 grid)."""
    lut = torch.tensor(FP4)
    rows = w.transpose(1, 2).float()
    e, r, k = rows.shape
    groups = rows.reshape(e, r, k // 32, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    codes = (groups / torch.exp2(exp)[..., None])[..., None].sub(lut).abs().argmin(-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    grid = (lut[codes] * torch.exp2(exp)[..., None]).reshape(e, r, k).transpose(1, 2).contiguous()
    return blocks, (exp + 127).to(torch.uint8), grid


@pytest.fixture(scope="module")
def mxfp4_checkpoint(gpt_oss, tmp_path_factory):
    """The tiny model's experts in MXFP4 as the hub's gpt-oss checkpoints hold them (two shards, each
    expert weight's blocks in the first and its scales in the second), and the float export of the same
    weights (on the MXFP4 grid) beside it."""
    import json

    from safetensors.torch import load_file, save_file

    path, _ = gpt_oss
    tensors = {k: v for f in path.glob("*.safetensors") for k, v in load_file(f).items()}
    packed, grid_dir, mx_dir = {}, tmp_path_factory.mktemp("mxfp4-grid"), tmp_path_factory.mktemp("mxfp4")
    for name, w in list(tensors.items()):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name + "_blocks"], packed[name + "_scales"], grid = mxfp4_encode(w)
            tensors[name] = grid.to(w.dtype)
    save_file(tensors, grid_dir / "model.safetensors")
    rest = {k: v for k, v in tensors.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    shards = {"model-00001-of-00002.safetensors": rest | {k: v for k, v in packed.items() if k.endswith("_blocks")},
              "model-00002-of-00002.safetensors": {k: v for k, v in packed.items() if k.endswith("_scales")}}
    for file, part in shards.items():
        save_file(part, mx_dir / file)
    (mx_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: file for file, part in shards.items() for name in part}}))
    config = json.loads((path / "config.json").read_text())
    (grid_dir / "config.json").write_text(json.dumps(config))
    (mx_dir / "config.json").write_text(json.dumps(config | {"quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}))
    return mx_dir, grid_dir


def test_an_mxfp4_checkpoint_is_its_float_export_and_transformers_model(mxfp4_checkpoint):
    """The hub's gpt-oss layout (MXFP4 experts, blocks and scales in different shards) loads to exactly the
    weights of its float export, and its logits are transformers' own dequantized model's."""
    import transformers

    mx_dir, grid_dir = mxfp4_checkpoint
    got = load(mx_dir).prefill_logits(PROMPT)
    assert torch.equal(got, load(grid_dir).prefill_logits(PROMPT))
    hf = transformers.GptOssForCausalLM.from_pretrained(
        mx_dir, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32)
    torch.testing.assert_close(got, hf_logits(hf, PROMPT), rtol=1e-4, atol=1e-4)


def test_mxfp4_dequantize_is_transformers_on_every_code_and_scale():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from shared.model.loader import mxfp4_dequantize

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 40, 4), dtype=torch.uint8, generator=g)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code, in both nibbles
    assert torch.equal(mxfp4_dequantize(blocks, scales),
                       convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    with pytest.raises(ValueError, match="do not pair"):
        mxfp4_dequantize(blocks, scales[:, :, :3])


def test_other_quantized_checkpoints_and_gguf_files_are_refused_by_name(tmp_path):
    import json

    from shared.model.loader import gguf_family

    (tmp_path / "config.json").write_text(json.dumps(BASE | {"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match="unsupported quantized checkpoint of gpt_oss \\(quant_method 'fp8'\\)"):
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


@pytest.mark.parametrize("tp", [2, 4])
def test_split_over_ranks_gives_the_whole_models_logits(gpt_oss, tp):
    """4 heads, 2 KV heads (each on two ranks at tp 4), 32 channels per expert: every rank holds its
    heads' sinks and q/k/v bias rows and its channels of every expert and of their gate_up biases;
    o_proj's bias is added after the all-reduce, the experts' down biases by rank 0 alone."""
    from thread_ranks import run_ranks

    path, _ = gpt_oss
    whole = load(path).prefill_logits(PROMPT)
    results = run_ranks(tp, lambda group: load_model(path, "hf", torch.device("cpu"), torch.float32,
                                                     group).prefill_logits(PROMPT))
    assert all(torch.equal(results[0], r) for r in results[1:])
    torch.testing.assert_close(results[0], whole, rtol=1e-4, atol=1e-4)
    assert torch.equal(results[0].argmax(-1), whole.argmax(-1))


def test_the_down_bias_on_every_rank_moves_the_logits(gpt_oss, monkeypatch):
    """The test above fails if every rank adds the experts' down biases (the all-reduce then sums them
    twice): the rule that puts them on rank 0 alone is what makes the split exact."""
    from shared.model import parallel
    from thread_ranks import run_ranks

    path, _ = gpt_oss
    whole = load(path).prefill_logits(PROMPT)
    monkeypatch.setattr(parallel, "_WHOLE", (*parallel._WHOLE, *parallel._ONCE))
    logits = run_ranks(2, lambda group: load_model(path, "hf", torch.device("cpu"), torch.float32,
                                                   group).prefill_logits(PROMPT))[0]
    assert (logits - whole).abs().max() > 0.05


def test_greedy_at_two_ranks_is_one_ranks(gpt_oss):
    """The engine over a group of two (rank 0 drives, rank 1 follows): chunked prefill beside decodes
    over 8-token blocks, each prompt's 16 greedy tokens those of one process."""
    from shared.engine.parallel import ParallelModel, follow
    from thread_ranks import run_ranks

    path, _ = gpt_oss
    config = EngineConfig(kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=24)
    prompts = [PROMPT[:n] for n in (5, 40, 70)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = LLMEngine(load(path), config).generate(prompts, params)

    def rank(world):
        model = load_model(path, "hf", torch.device("cpu"), torch.float32, world)
        if world.rank > 0:
            return follow(model, world)
        engine = LLMEngine(ParallelModel(model, world), config)
        try:
            return engine.generate(prompts, params)
        finally:
            engine.close()

    assert run_ranks(2, rank)[0] == want


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_stages_give_the_whole_models_logits(gpt_oss, tp):
    """Two stages (layers 0-1 and 2: a windowed and a global layer, then a windowed one), each of
    ``tp`` ranks: the stages run the same per-layer code, sinks and biases included."""
    from shared.engine.parallel import join_stage
    from thread_ranks import run_ranks

    path, _ = gpt_oss
    whole = load(path).prefill_logits(PROMPT)

    def stage_logits(world):
        group, pipeline = join_stage(world, tp, 2, 3)
        return load_model(path, "hf", torch.device("cpu"), torch.float32, group, pipeline=pipeline).prefill_logits(
            PROMPT)

    results = run_ranks(2 * tp, stage_logits)
    assert all(r is None for r in results[tp:])
    for logits in results[:tp]:
        torch.testing.assert_close(logits, whole, rtol=1e-4, atol=1e-4)


def test_a_layers_shards_hold_each_head_and_channel_once():
    """shard_layer on one gpt-oss layer: the sinks cut by query head (4 heads, 2 ranks), the router, its
    bias and o_proj's bias whole on every rank, the experts' down bias on rank 0 alone, each rank's
    gate_up bias the bias of its own gate_up rows; a tensor with no rule is refused, not dropped."""
    from shared.model.parallel import shard_layer

    cfg = ModelConfig.from_hf(BASE | dict(hidden_size=8, head_dim=4, num_local_experts=2, intermediate_size=6))
    gen = torch.Generator().manual_seed(0)
    experts, hidden, width, d = 2, 8, 6, 4
    shapes = dict(qkv=((4 + 2 * 2) * d, hidden), qkv_bias=((4 + 2 * 2) * d,), o_proj=(hidden, 4 * d), o_bias=(hidden,),
                  sinks=(4,), attn_norm=(hidden,), mlp_norm=(hidden,), router=(experts, hidden),
                  router_bias=(experts,), experts_gate_up=(experts, 2 * width, hidden),
                  experts_gate_up_bias=(experts, 2 * width), experts_down=(experts, hidden, width),
                  experts_down_bias=(experts, hidden))
    w = {name: torch.randn(*shape, generator=gen) for name, shape in shapes.items()}
    parts = [shard_layer(cfg, w, rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat([p["sinks"] for p in parts]), w["sinks"])
    for name in ("o_bias", "router", "router_bias"):
        assert all(torch.equal(p[name], w[name]) for p in parts)
    assert torch.equal(parts[0]["experts_down_bias"], w["experts_down_bias"]) and "experts_down_bias" not in parts[1]
    x = torch.randn(3, hidden, generator=gen)
    for e in range(experts):  # gate channels, then up channels: the whole expert's, rank by rank
        full = torch.nn.functional.linear(x, w["experts_gate_up"][e], w["experts_gate_up_bias"][e])
        got = [torch.nn.functional.linear(x, p["experts_gate_up"][e], p["experts_gate_up_bias"][e]).chunk(2, -1)
               for p in parts]
        torch.testing.assert_close(torch.cat([g for g, _ in got] + [u for _, u in got], -1), full)
    with pytest.raises(RuntimeError, match=r"no tensor-parallel split for the layer tensors \['mlp_bias'\]"):
        shard_layer(cfg, w | {"mlp_bias": torch.zeros(hidden)}, 0, 2)


def test_it_decodes_eagerly_under_compile(tmp_path, caplog):
    from test_compiled_decode import test_families_the_compiled_step_does_not_cover_decode_eagerly as check

    check(tmp_path, "gpt_oss", "a mixture of experts", caplog)
