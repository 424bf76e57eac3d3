"""A float16 KV pool (``--kv-cache-dtype float16``) under the real SmolLM2 in float32: how far
rounding the cached K/V moves the model, and that an engine on such a pool answers."""

import torch

from loadtest.bench.quality import KvDtypeModel
from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.model.quant import EVAL_PASSAGE, compare_models


def test_a_float16_pool_barely_moves_the_float32_model(smol_model, smol_tokenizer):
    ids = smol_tokenizer.encode(EVAL_PASSAGE)
    got = compare_models(smol_model, KvDtypeModel(smol_model, torch.float16), ids)
    print(got)
    assert got["top1_agreement"] >= 0.98
    assert got["kl"] < 0.005
    assert got["perplexity"] <= 1.01 * got["perplexity_reference"]


def test_an_engine_on_a_float16_pool_answers(smol_model, smol_tokenizer):
    engine = LLMEngine(smol_model, EngineConfig(kv_cache_memory=32 << 20, kv_cache_dtype="float16"))
    assert engine.kv_cache.dtype == torch.float16
    prompt = smol_tokenizer.encode(smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]))
    [answer] = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))
    assert "Paris" in smol_tokenizer.decode(answer)
