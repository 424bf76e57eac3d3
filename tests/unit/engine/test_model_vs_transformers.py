"""Our model and engine against transformers on tiny random-weight models of each family."""

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.model.config import ModelConfig
from shared.model.loader import load_model
from tiny_hf_models import save_tiny

LONG_PROMPT = 128  # tokens: a query tile and more, ten times the tiny models' sliding window


def assert_greedy_under_hf(model, prompt, generated, tol=1e-4):
    """Teacher-force our tokens through transformers: each must be its argmax (up to ``tol``, since
    random-weight models have near-ties that float rounding may break either way)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1]
    chosen = logits.gather(1, torch.tensor(generated)[:, None])[:, 0]
    gap = logits.max(-1).values - chosen
    assert gap.max() <= tol, f"token {int(gap.argmax())} is {float(gap.max()):.2e} below transformers' best"


def test_prefill_logits_match(tiny_hf):
    _, path, hf = tiny_hf
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=16))
    prompt = [(7 * i + 3) % 256 for i in range(40)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    (out,) = engine.step()
    top = out.logprobs[0].top_logprobs
    ref_lp = torch.log_softmax(ref, -1)
    assert [t for t, _ in top] == ref_lp.topk(5).indices.tolist()
    assert torch.allclose(torch.tensor([lp for _, lp in top]), ref_lp.topk(5).values, atol=1e-4)


def test_logits_at_every_position_match(tiny_hf):
    """The whole model in float32 (Qwen3's q/k norms, Phi-3's fused checkpoint tensors, OLMo 2's
    post-norms, Granite's multipliers, Gemma's soft-caps, local rope and sliding windows included):
    every position's logits within float32 rounding of transformers'. The prompt runs far past the
    tiny Gemmas' window, which their local layers attend over and their global layers do not."""
    _, path, hf = tiny_hf
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    prompt = [(13 * i + 5) % 256 for i in range(LONG_PROMPT)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    got = model.prefill_logits(prompt)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_batched_greedy_matches_transformers(tiny_hf):
    kind, path, hf = tiny_hf
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    # a small budget forces chunked prefill mixed with decodes; block size 8 puts boundaries inside
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=24))
    prompts = [[(5 * i + k) % 256 for i in range(n)] for k, n in ((1, 3), (2, 37), (3, 90), (4, 16))]
    if kind == "llama3":  # positions past original_max_position_embeddings exercise the scaling
        prompts.append([(11 * i) % 256 for i in range(130)])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = engine.generate(prompts, params)
    for prompt, generated in zip(prompts, got):
        assert len(generated) == 12
        assert_greedy_under_hf(hf, prompt, generated)
    assert engine.kv.pool.num_free_blocks == engine.num_blocks


# beside conftest's ``tiny_hf``, whose other users quantize every family (the experts load unquantized only)
NEWER_FAMILIES = ["smollm3", "mixtral", "qwen3_moe"]


@pytest.fixture(scope="module", params=NEWER_FAMILIES)
def newer_tiny_hf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_tiny(request.param, path)


def test_newer_families_prefill_logits_match(newer_tiny_hf):
    test_prefill_logits_match(newer_tiny_hf)


def test_newer_families_logits_at_every_position_match(newer_tiny_hf):
    """SmolLM3's layer without rotary; Mixtral's renormalised top 2 of 4 experts; Qwen3-MoE's top 2
    of 8, not renormalised, beside a dense layer (mlp_only_layers) and per-head q/k norms."""
    test_logits_at_every_position_match(newer_tiny_hf)


def test_newer_families_batched_greedy_matches_transformers(newer_tiny_hf):
    test_batched_greedy_matches_transformers(newer_tiny_hf)


@pytest.mark.parametrize("kind, differs", [("smollm3", "layers without rotary"), ("mixtral", "a mixture of experts"),
                                           ("qwen3_moe", "a mixture of experts")])
def test_newer_families_decode_eagerly_under_compile(tmp_path, kind, differs, caplog):
    from test_compiled_decode import test_families_the_compiled_step_does_not_cover_decode_eagerly as check

    check(tmp_path, kind, differs, caplog)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_experts_weigh_their_outputs_as_transformers_in_bfloat16(tmp_path, kind):
    """Below float32 the families part: Mixtral scales the experts' outputs by float32 weights,
    Qwen3-MoE rounds the weights to the model's dtype first (``Moe.round_weights``); the other way
    round moves the tiny models' logits by 0.1 (Mixtral) and 0.8 (Qwen3-MoE). Both sum in float32."""
    from transformers import AutoModelForCausalLM

    save_tiny(kind, tmp_path)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    prompt = [(13 * i + 5) % 256 for i in range(LONG_PROMPT)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(model.prefill_logits(prompt), ref, rtol=0, atol=1e-2)


PHI3 = dict(model_type="phi3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=4096)


@pytest.mark.parametrize("rope, named", [
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "'longrope'"),
    ({"type": "su", "short_factor": [1.0], "long_factor": [2.0]}, "'su'"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),
])
def test_phi3_rope_it_does_not_compute_is_refused_by_name(rope, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf(PHI3 | {"rope_scaling": rope})


def test_a_sliding_window_keeps_the_whole_context():
    """Phi-3-mini-4k's window (2047) under its 4096 positions: every layer attends over its window,
    and the context is the model's whole. Qwen3 windows nothing unless use_sliding_window says so."""
    phi3 = ModelConfig.from_hf(PHI3 | {"sliding_window": 2047})
    assert (phi3.max_position_embeddings, phi3.sliding_window, phi3.window_layers) == (4096, 2047, (0, 1))
    assert ModelConfig.from_hf(PHI3).window_layers == ()
    qwen3 = PHI3 | {"model_type": "qwen3", "sliding_window": 1024, "use_sliding_window": False}
    assert ModelConfig.from_hf(qwen3).max_position_embeddings == 4096
    assert ModelConfig.from_hf(qwen3).window_layers == () and ModelConfig.from_hf(qwen3).qk_norm


def test_qwen3_split_over_two_ranks_gives_the_whole_models_logits(tmp_path):
    """q_norm and k_norm ([head_dim]) go whole to every rank, beside its heads of q/k/v."""
    from test_tensor_parallel import run_ranks

    save_tiny("qwen3", tmp_path)
    ids = [(7 * i + 3) % 256 for i in range(30)]
    whole = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32).prefill_logits(ids)
    results = run_ranks(2, lambda group: load_model(tmp_path, "hf", torch.device("cpu"), torch.float32,
                                                    group).prefill_logits(ids))
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind, tp", [("olmo2", 2), ("olmo2", 4), ("gemma2", 2), ("smollm3", 2), ("mixtral", 2),
                                      ("qwen3_moe", 2)])
def test_new_families_split_over_ranks_give_the_whole_models_logits(tmp_path, kind, tp):
    """OLMo 2's q/k norms span every head: each rank holds its heads' part of the weights and the
    mean square is summed over the group (at 4 ranks each of the 2 KV heads sits on two ranks, and
    counts twice in both sum and width). Post-norms act on the all-reduced outputs, whole on every
    rank; Gemma 2's scores are capped per head, its logits after the gather. Every expert is cut as
    the dense MLP is (its channels column- then row-parallel), the router whole: every rank routes alike."""
    from test_tensor_parallel import run_ranks

    save_tiny(kind, tmp_path)
    ids = [(7 * i + 3) % 256 for i in range(30)]
    whole = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32).prefill_logits(ids)
    results = run_ranks(tp, lambda group: load_model(tmp_path, "hf", torch.device("cpu"), torch.float32,
                                                     group).prefill_logits(ids))
    assert all(torch.equal(results[0], r) for r in results[1:])
    torch.testing.assert_close(results[0], whole, rtol=1e-4, atol=1e-4)


def test_a_model_type_not_built_is_refused_in_one_line_naming_those_that_are(tmp_path):
    """Before any other field is read: a Mamba config has no attention heads to read."""
    from shared.model.loader import read_config

    (tmp_path / "config.json").write_text('{"model_type": "mamba", "hidden_size": 64}')
    for load in (lambda: load_model(tmp_path, "hf", torch.device("cpu"), torch.float32),
                 lambda: read_config(tmp_path, "hf")):
        with pytest.raises(ValueError) as caught:
            load()
        assert str(caught.value) == ("unsupported model_type 'mamba' (supported: llama, mistral, qwen2, qwen3, phi3, "
                                     "olmo2, granite, gemma2, gemma3_text, smollm3, mixtral, qwen3_moe, gpt_oss, "
                                     "deepseek_v3)")


GEMMA2 = PHI3 | dict(model_type="gemma2", head_dim=16, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                     attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
                     max_position_embeddings=8192)


def test_each_familys_differences_are_read_from_its_config():
    gemma2 = ModelConfig.from_hf(GEMMA2)
    assert gemma2.max_position_embeddings == 8192 and gemma2.sliding_window == 4096
    assert gemma2.window_layers == (0,)  # every other layer, from the first
    assert (gemma2.activation, gemma2.attention_scale, gemma2.attn_softcap, gemma2.final_softcap) == (
        "gelu_tanh", 24 ** -0.5, 50.0, 30.0)
    assert gemma2.embedding_multiplier == 8.0 and gemma2.post_norms and gemma2.pre_norms
    olmo2 = ModelConfig.from_hf(PHI3 | dict(model_type="olmo2"))
    assert (olmo2.qk_norm, olmo2.pre_norms, olmo2.post_norms) == ("whole", False, True)
    granite = ModelConfig.from_hf(PHI3 | dict(model_type="granite", embedding_multiplier=12.0, residual_multiplier=0.22,
                                              attention_multiplier=0.0078125, logits_scaling=8.0))
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.attention_scale,
            granite.logits_scaling) == (12.0, 0.22, 0.0078125, 8.0)
    # Gemma 3 as transformers 4 wrote it: rope_theta, rope_local_base_freq, a linear rope_scaling
    gemma3 = ModelConfig.from_hf(GEMMA2 | dict(model_type="gemma3_text", num_hidden_layers=6, sliding_window=1024,
                                               rope_theta=1e6, rope_local_base_freq=1e4, attn_logit_softcapping=None,
                                               final_logit_softcapping=None,
                                               rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert gemma3.local_layers == (0, 1, 2, 3, 4) and gemma3.local_rope_theta == 1e4 and gemma3.rope_theta == 1e6
    assert gemma3.rope_freq_factors == (8.0,) * 8 and gemma3.max_position_embeddings == 8192
    assert gemma3.sliding_window == 1024 and gemma3.window_layers == gemma3.local_layers
    assert gemma3.attn_softcap is None and gemma3.qk_norm == "head"


def test_smollm3_and_moe_configs_are_read_as_hub_checkpoints_write_them():
    """SmolLM3-3B's config.json lists no_rope_layers; without it every 4th layer has no rotary.
    Qwen3-MoE's hub configs count experts in num_experts, and decoder_sparse_step 2 leaves the
    even layers dense."""
    smollm3 = PHI3 | dict(model_type="smollm3", num_hidden_layers=8)
    assert ModelConfig.from_hf(smollm3).nope_layers == (3, 7)
    assert ModelConfig.from_hf(smollm3 | dict(no_rope_layers=[1, 1, 0, 1, 1, 1, 0, 0])).nope_layers == (2, 6, 7)
    qwen3_moe = ModelConfig.from_hf(PHI3 | dict(
        model_type="qwen3_moe", num_hidden_layers=6, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        decoder_sparse_step=2, mlp_only_layers=[5], norm_topk_prob=True))
    assert (qwen3_moe.moe.num_experts, qwen3_moe.moe.top_k, qwen3_moe.moe.intermediate_size) == (128, 8, 768)
    assert qwen3_moe.moe.layers == (1, 3) and qwen3_moe.moe.renormalize and qwen3_moe.qk_norm == "head"
    mixtral = ModelConfig.from_hf(PHI3 | dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2,
                                              norm_topk_prob=False))
    assert mixtral.moe.renormalize and mixtral.moe.layers == (0, 1) and mixtral.moe.intermediate_size == 128
    assert qwen3_moe.moe.round_weights and not mixtral.moe.round_weights
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf(smollm3 | dict(mlp_bias=True))


@pytest.mark.parametrize("fields, named", [
    ({"hidden_activation": "gelu"}, "hidden_act 'gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "'dynamic'"),
])
def test_what_gemma_configs_ask_and_is_not_built_is_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf(GEMMA2 | fields)


def test_gathered_attention_under_a_cap_far_above_the_scores_is_the_backends_attention():
    """Decode rows and prefill chunks of one step, over a pool whose unused slots hold NaN; with a
    cap of 1e4 the scores (a few units) are not bent, so the result is plain attention's."""
    from shared.model.attention import AttentionMetadata, TorchAttentionBackend, gathered_attention

    gen = torch.Generator().manual_seed(0)
    bs, kv_heads, heads, d = 4, 2, 4, 16
    k_cache = torch.full((12, bs, kv_heads, d), float("nan"))
    v_cache = k_cache.clone()
    seq_lens, q_lens = [7, 3, 10, 5], [1, 1, 4, 5]  # two decode rows, then two prefill chunks
    tables = torch.tensor([[0, 1, 0], [2, 0, 0], [3, 4, 5], [6, 7, 0]], dtype=torch.int32)
    for row, n in enumerate(seq_lens):
        for pos in range(n):
            block, offset = int(tables[row, pos // bs]), pos % bs
            k_cache[block, offset] = torch.randn(kv_heads, d, generator=gen)
            v_cache[block, offset] = torch.randn(kv_heads, d, generator=gen)
    q = torch.randn(sum(q_lens), heads, d, generator=gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(num_decodes=2, slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long),
                             block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             query_start_loc=starts, max_seq_len=10, max_query_len=5)
    want = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, 0.25)
    got = gathered_attention(q, k_cache, v_cache, meta, 0.25, softcap=1e4)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    bent = gathered_attention(q, k_cache, v_cache, meta, 0.25, softcap=0.5)  # and a low cap does bend them
    assert (bent - want).abs().max() > 0.05
