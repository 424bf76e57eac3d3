"""Our model and engine against transformers on tiny random-weight models of each family."""

import torch

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.model.loader import load_model


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
