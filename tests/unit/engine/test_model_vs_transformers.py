"""Our model and engine against transformers on tiny random-weight models of each family."""

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.model.config import ModelConfig
from shared.model.loader import load_model
from tiny_hf_models import save_tiny


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
    """The whole model in float32 (Qwen3's q/k norms, Phi-3's fused checkpoint tensors included):
    every position's logits within float32 rounding of transformers'."""
    _, path, hf = tiny_hf
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    prompt = [(13 * i + 5) % 256 for i in range(50)]
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


def test_context_is_cut_to_the_sliding_window():
    """Phi-3-mini-4k's window (2047) under its 4096 positions: attention over a window is not
    implemented, so the context stops where it would start to matter."""
    assert ModelConfig.from_hf(PHI3 | {"sliding_window": 2047}).max_position_embeddings == 2047
    assert ModelConfig.from_hf(PHI3).max_position_embeddings == 4096
    qwen3 = PHI3 | {"model_type": "qwen3", "sliding_window": 1024, "use_sliding_window": False}
    assert ModelConfig.from_hf(qwen3).max_position_embeddings == 4096
    assert ModelConfig.from_hf(qwen3).qk_norm


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
