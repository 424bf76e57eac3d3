"""DeepSeek-V3 against transformers on tiny random-weight models: multi-head latent attention with its
compressed latent in the KV pool (q through a low-rank pair, or one q_proj with YaRN and mscale_all_dim),
interleaved rotary, dense layers before experts chosen by a group-limited sigmoid router beside a shared
expert; through the engine's paged pool (chunked prefill, decode rows, a prefix hit); split over tensor-parallel
ranks (query heads split, the latent replicated) and pipeline stages; in bfloat16 and quantized; and what is
refused."""

import dataclasses
import json

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.kvcache.layout import KvCacheSpec, layer_views
from shared.model.attention import AttentionMetadata, TorchAttentionBackend
from shared.model.config import ModelConfig
from shared.model.loader import load_model
from thread_ranks import run_ranks
from tiny_hf_models import save_tiny

PROMPT = [(13 * i + 5) % 256 for i in range(96)]
# one q_proj (q_lora_rank None) and YaRN over 32 original positions, its mscale_all_dim scaling the softmax
YARN = dict(q_lora_rank=None, max_position_embeddings=128, rope_parameters={
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
    "mscale_all_dim": 0.8, "rope_theta": 10000.0, "beta_fast": 32.0, "beta_slow": 1.0})
VARIANTS = {"q_lora": {}, "q_proj_yarn": YARN}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def deepseek(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, save_tiny("deepseek_v3", path, **VARIANTS[request.param])


@pytest.fixture(scope="module")
def q_lora(tmp_path_factory):
    path = tmp_path_factory.mktemp("q_lora")
    return path, save_tiny("deepseek_v3", path)


def load(path):
    return load_model(path, "hf", torch.device("cpu"), torch.float32)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_config_is_read_as_transformers_reads_it(deepseek):
    from shared.model.llama import rope_attention_factor, rope_inv_freq

    path, hf = deepseek
    cfg = load(path).cfg
    mla, moe = cfg.mla, cfg.moe
    assert (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (32, 16, 8, 16)
    assert mla.q_lora_rank == hf.config.q_lora_rank and mla.rope_interleave
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (1, 20, 8)  # the pool's slot: the latent in halves
    assert cfg.attention_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.layers, moe.renormalize) == (8, 2, 16, (1, 2), True)
    grouped = moe.group_limited
    assert (grouped.num_groups, grouped.topk_groups, grouped.routed_scaling_factor, grouped.num_shared_experts) == (
        2, 1, 2.5, 1)
    rotary = hf.model.rotary_emb
    torch.testing.assert_close(rope_inv_freq(cfg), rotary.inv_freq, rtol=1e-6, atol=0)
    assert rope_attention_factor(cfg) == pytest.approx(rotary.attention_scaling)


def test_logits_at_every_position_match(deepseek):
    path, hf = deepseek
    torch.testing.assert_close(load(path).prefill_logits(PROMPT), hf_logits(hf, PROMPT), rtol=1e-4, atol=1e-4)


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(deepseek):
    """In bfloat16 the logits leave float32's by as much as transformers' own bfloat16 model's do (mean
    absolute error 0.045 / 0.053 for both on the two variants; one position's routing flips in each, so the
    maximum is no measure), and the top-1 token agrees as often (0.95 / 0.94 against 0.96 / 0.93)."""
    import copy

    path, hf = deepseek
    want = hf_logits(hf, PROMPT)
    theirs = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), PROMPT).float()
    ours = load_model(path, "hf", torch.device("cpu"), torch.bfloat16).prefill_logits(PROMPT).float()

    def mean_error(logits):
        return float((logits - want).abs().mean())

    def top1(logits):
        return float((logits.argmax(-1) == want.argmax(-1)).float().mean())

    assert mean_error(ours) <= 1.25 * mean_error(theirs), (mean_error(ours), mean_error(theirs))
    assert top1(ours) >= top1(theirs) - 3 / len(PROMPT), (top1(ours), top1(theirs))


def test_the_correction_bias_and_the_interleaved_rotary_count(q_lora):
    """The test above fails without the router's correction bias, or with the rope channels rotated as
    rotate-half pairs instead of DeepSeek's interleaved ones."""
    from shared.model.loader import build_model, load_hf_dir

    path, hf = q_lora
    want = hf_logits(hf, PROMPT)
    model = load(path)
    for layer in model.layers:
        if layer.moe is not None:
            layer.moe.correction = torch.zeros_like(layer.moe.correction)
    assert (model.prefill_logits(PROMPT) - want).abs().max() > 0.05
    cfg, tensors = load_hf_dir(path)
    cfg = dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, rope_interleave=False))
    model = build_model(cfg, tensors, torch.device("cpu"), torch.float32)
    assert (model.prefill_logits(PROMPT) - want).abs().max() > 0.05


def test_routing_is_transformers_router_on_every_path(q_lora):
    """Layer 1's router on 64 random rows: the experts and weights of transformers' ``DeepseekV3TopkRouter``
    (groups, correction bias, renormalisation, scaling); the block's eager loop, every expert over every
    token (a CUDA graph's capture) and the grouped path (its torch reference) give one output."""
    from kernels.moe_grouped import grouped_linear_ref

    path, hf = q_lora
    block = load(path).layers[1].moe
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    experts, weights = block.route(x)
    with torch.no_grad():
        _, want_weights, want_experts = hf.model.layers[1].mlp.gate(x)
    order, want_order = experts.argsort(-1), want_experts.argsort(-1)
    assert torch.equal(experts.gather(1, order), want_experts.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))
    group = experts // 4  # each token's two experts from one group (topk_group 1), both groups in use
    assert torch.equal(group[:, 0], group[:, 1]) and set(group.flatten().tolist()) == {0, 1}
    eager = block.forward_each_expert(x, experts, weights)
    torch.testing.assert_close(block.forward_every_expert(x, experts, weights), eager, rtol=1e-5, atol=1e-5)
    grouped = block.forward_grouped(x, experts, weights, grouped_linear_ref, count=False)
    torch.testing.assert_close(grouped, eager, rtol=1e-5, atol=1e-5)


def prefill_pool(model, tokens, block_size=8):
    """One prefill of ``tokens`` over a scratch pool of the engine's layout; returns the pool."""
    n = len(tokens)
    num_blocks = -(-n // block_size)
    kv = KvCacheSpec(len(model.layers), model.num_kv_heads, model.cfg.head_dim, block_size, model.dtype).allocate(
        num_blocks, "cpu")
    meta = AttentionMetadata(num_decodes=0, slot_mapping=torch.arange(n), block_tables=torch.arange(
        num_blocks, dtype=torch.int32)[None], seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_seq_len=n, max_query_len=n)
    model.forward(torch.tensor(tokens), torch.arange(n), kv, meta, TorchAttentionBackend())
    return kv


def test_the_pool_holds_transformers_latent_cache(q_lora):
    """Per token and layer the pool's K plane then V plane are transformers' cached latent: the normed
    compressed kv [32], then the rotated shared rope key [8]; nothing per head."""
    path, hf = q_lora
    model = load(path)
    tokens = PROMPT[:37]
    kv = prefill_pool(model, tokens)
    with torch.no_grad():
        cache = hf(torch.tensor([tokens]), use_cache=True).past_key_values
    for i, layer in enumerate(cache.layers):
        k_plane, v_plane = layer_views(kv, i)  # [N, bs, 1, 20] each
        latent = torch.cat([k_plane, v_plane], dim=-1).reshape(-1, 40)[:len(tokens)]
        want = torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1)  # [S, 32 + 8]
        torch.testing.assert_close(latent, want, rtol=1e-5, atol=1e-5)


def test_kv_bytes_per_token_are_a_quarter_of_per_head_kv_or_less(q_lora):
    """The engine's pool holds layers x (kv_lora_rank + rope) values a token: 3 x 40 against the
    3 x 4 heads x (24 + 16) that per-head K/V would take (1/4); DeepSeek-V3's shape, 61 x 576 against
    61 x 128 x (192 + 128) (1/71)."""
    path, _ = q_lora
    engine = LLMEngine(load(path), EngineConfig(kv_cache_memory=1 << 20, block_size=8))
    spec = engine.kv_spec
    per_head = 3 * 4 * (24 + 16) * 4  # float32
    assert spec.bytes_per_token == 3 * (32 + 8) * 4 and spec.bytes_per_token * 4 <= per_head
    cfg = ModelConfig.from_hf(V3_SHAPE)
    latent = KvCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, torch.bfloat16).bytes_per_token
    assert latent == 61 * 576 * 2 and 61 * 128 * (192 + 128) * 2 // latent == 71


V3_SHAPE = dict(  # DeepSeek-V3's config.json, less what the tiny models show already
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
    n_shared_experts=1, moe_intermediate_size=2048, first_k_dense_replace=3, routed_scaling_factor=2.5,
    norm_topk_prob=True, max_position_embeddings=163840, rope_theta=10000, rope_scaling={
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn"})


def test_the_hub_config_of_deepseek_v3():
    """Its softmax scale is 192^-1/2 x (0.1 ln 40 + 1)^2; its 58 layers of experts follow 3 dense ones."""
    import math

    cfg = ModelConfig.from_hf(V3_SHAPE)
    assert cfg.attention_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert cfg.moe.layers == tuple(range(3, 61)) and cfg.moe.group_limited.num_groups == 8
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (1, 288, 64)


def generate_hf(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_greedy_through_the_engine_is_transformers_generate(q_lora):
    """Chunked prefill (24 tokens a step) beside decode rows over 8-token blocks: each prompt's 12 greedy
    tokens are transformers' generate's."""
    path, hf = q_lora
    engine = LLMEngine(load(path), EngineConfig(kv_cache_memory=1 << 20, block_size=8, max_num_batched_tokens=24))
    prompts = [PROMPT[:n] for n in (5, 40, 70)]
    got = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert got == [generate_hf(hf, prompt, 12) for prompt in prompts]
    assert engine.kv.pool.num_free_blocks == engine.num_blocks


def test_a_prefix_hit_then_chunks_over_it_is_transformers_generate(q_lora):
    """A second prompt sharing 40 tokens (5 blocks of 8) with a finished one reads their latent from the
    pool and prefills its 30 new tokens in chunks of 16 over them."""
    path, hf = q_lora
    engine = LLMEngine(load(path), EngineConfig(kv_cache_memory=1 << 20, block_size=8, max_num_batched_tokens=16))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = PROMPT[:45]
    engine.generate([first], params)
    second = first[:40] + [(7 * i + 1) % 256 for i in range(30)]
    engine.add_request("hit", second, params)
    generated, cached = [], None
    while cached is None or len(generated) < 8:
        for out in engine.step():
            generated += out.new_token_ids
            cached = out.num_cached_tokens
    assert cached == 40
    assert generated == generate_hf(hf, second, 8)


# Top-1 agreement of each quantized method with float32 over PROMPT (96 tokens): q_lora int8 0.875,
# int8-precise 0.885, gguf 0.865; q_proj_yarn 0.896 / 0.958 / 0.917. The tiny random model's logits are flat.
MIN_AGREEMENT = {"int8": 0.8, "int8-precise": 0.8, "gguf": 0.8}


@pytest.mark.parametrize("method", sorted(MIN_AGREEMENT))
def test_quantized_latent_attention_keeps_the_absorbed_factors_float(deepseek, method):
    """int8 and gguf replace the projections into q and the latent, o_proj and the MLP and experts; W_UK and
    W_UV, the factors absorbed into the query and the output, stay float. Greedy tokens through the engine
    are a request's own, alone or among others."""
    from shared.model.quant import BlockWeight, Int8Weight

    path, _ = deepseek
    model = load(path)
    want = model.prefill_logits(PROMPT)
    model.quantize(method, PROMPT if method == "int8" else None)
    assert model.quantization == method
    kind = BlockWeight if method == "gguf" else Int8Weight
    for layer in model.layers:
        assert isinstance(layer.kv_a, kind) and isinstance(layer.o_proj, kind)  # inputs 64 wide: whole blocks
        assert isinstance(layer.q if layer.q is not None else layer.q_a, kind)  # q_b's 48 inputs: float in gguf
        assert type(layer.w_uk) is torch.Tensor and type(layer.w_uv) is torch.Tensor
    agreement = float((model.prefill_logits(PROMPT).argmax(-1) == want.argmax(-1)).float().mean())
    assert agreement >= MIN_AGREEMENT[method], agreement
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=24,
                                           quantization=method))
    prompts = [[(5 * i + k) % 256 for i in range(n)] for k, n in ((1, 3), (2, 37), (3, 90))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts, params) == [engine.generate([p], params)[0] for p in prompts]


def test_what_is_not_built_is_refused_by_name(tmp_path):
    from shared.model.loader import gguf_family

    with pytest.raises(ValueError, match="unsupported kv_lora_rank \\+ qk_rope_head_dim = 41 of deepseek_v3"):
        ModelConfig.from_hf(V3_SHAPE | dict(kv_lora_rank=33, qk_rope_head_dim=8))
    (tmp_path / "config.json").write_text(json.dumps(V3_SHAPE | {"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match="unsupported quantized checkpoint of deepseek_v3 \\(quant_method 'fp8'\\)"):
        load(tmp_path)

    class DeepseekGguf:  # llama.cpp's converter writes DeepSeek-V3 as "deepseek2"
        tensors = ()

        def get(self, key, default=None):
            return "deepseek2" if key == "general.architecture" else default

    with pytest.raises(ValueError, match="unsupported GGUF architecture 'deepseek2'"):
        gguf_family(DeepseekGguf())


def test_it_decodes_eagerly_under_compile(tmp_path, caplog):
    from test_compiled_decode import test_families_the_compiled_step_does_not_cover_decode_eagerly as check

    check(tmp_path, "deepseek_v3", "a softmax scale of its own, a mixture of experts", caplog)


def rank_model(path, group, pipeline=None):
    return load_model(path, "hf", torch.device("cpu"), torch.float32, group, pipeline=pipeline)


@pytest.mark.parametrize("tp", [2, 4])
def test_split_over_ranks_gives_the_whole_models_logits_and_latent(deepseek, tp):
    """Each rank holds 4 / tp query heads (their q and kv_b rows, o_proj's columns), the experts' and the
    shared expert's channels, the router and the latent's projection whole: every rank's logits at every
    position are one process's (and transformers'), and every rank's pool holds the whole latent, TP=1's
    bytes per token (the latent replicated as a KV head is where there are fewer than the ranks)."""
    path, hf = deepseek
    model = load(path)
    whole, whole_kv = model.prefill_logits(PROMPT), prefill_pool(model, PROMPT)

    def shard(group):
        model = rank_model(path, group)
        assert model.layers[0].num_heads == 4 // tp and model.num_kv_heads == 1
        return model.prefill_logits(PROMPT), prefill_pool(model, PROMPT)

    results = run_ranks(tp, shard)
    for logits, kv in results:
        assert torch.equal(logits, results[0][0])  # every rank the same bits
        assert kv.shape == whole_kv.shape and kv[0, 0].nbytes == whole_kv[0, 0].nbytes  # TP=1's bytes a block
        torch.testing.assert_close(kv, whole_kv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][0], whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results[0][0], hf_logits(hf, PROMPT), rtol=1e-4, atol=1e-4)


def test_greedy_at_two_ranks_is_one_ranks(q_lora):
    """The engine over a group of two (rank 0 drives, rank 1 follows): chunked prefill beside decodes over
    8-token blocks, each prompt's 12 greedy tokens those of one process; the KV bytes a token on each rank
    are one process's: 3 layers x (32 + 8) float32 values, and the group's whole blocks (as the KV tiers and
    transfers read them) one process's pool's."""
    from shared.engine.parallel import ParallelModel, follow

    path, _ = q_lora
    config = EngineConfig(kv_cache_memory=1 << 20, block_size=8, max_num_batched_tokens=24)
    prompts = [PROMPT[:n] for n in (5, 40, 70)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = LLMEngine(load(path), config)
    want = one.generate(prompts, params)

    def rank(world):
        model = rank_model(path, world)
        if world.rank > 0:
            return follow(model, world)
        engine = LLMEngine(ParallelModel(model, world), config)
        try:
            got = engine.generate(prompts, params)
            return got, engine.kv_spec.bytes_per_token, engine.model.read_blocks(list(range(8)))
        finally:
            engine.close()

    got, bytes_per_token, blocks = run_ranks(2, rank)[0]
    assert got == want
    assert bytes_per_token == one.kv_spec.bytes_per_token == 3 * (32 + 8) * 4
    torch.testing.assert_close(blocks, one.kv_cache[:8], rtol=1e-5, atol=1e-5)


def test_a_split_that_does_not_divide_the_heads_is_refused_at_load(q_lora):
    from shared.model.parallel import check_tensor_parallel

    class FakeGroup:  # only its size is read before the refusal
        rank, size = 0, 3

    path, _ = q_lora
    want = r"^tensor parallel size 3 does not divide the model's 4 attention heads \(latent attention splits"
    with pytest.raises(ValueError, match=want):
        rank_model(path, FakeGroup())
    with pytest.raises(ValueError, match="tensor parallel size 8 does not divide the model's 4 attention heads"):
        check_tensor_parallel(load(path).cfg, 8)


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_stages_give_the_whole_models_logits(q_lora, tp):
    """Two stages (the dense layer 0 and layer 1 of experts, then layer 2), each of ``tp`` ranks: each
    stage's layers cache their latent in its own pool; stage 0's ranks get the whole model's logits."""
    from shared.engine.parallel import join_stage

    path, _ = q_lora
    whole = load(path).prefill_logits(PROMPT)

    def stage_logits(world):
        group, pipeline = join_stage(world, tp, 2, 3)
        model = rank_model(path, group, pipeline)
        assert len(model.layers) == (2, 1)[pipeline.stage]
        return model.prefill_logits(PROMPT)

    results = run_ranks(2 * tp, stage_logits)
    assert all(r is None for r in results[tp:])
    for logits in results[:tp]:
        torch.testing.assert_close(logits, whole, rtol=1e-4, atol=1e-4)
