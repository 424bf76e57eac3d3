"""A KV pool of another dtype than the model's (``--kv-cache-dtype``; float16 by default under a gguf
model): float16 under a float32 model holds twice the blocks in the same budget, keeps each K/V as
the model computed it rounded to float16, and the eager and compiled decode steps read it alike."""

from __future__ import annotations

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.engine.compiled.artifacts import engine_artifact_key
from shared.kvcache.layout import layer_views


def test_the_setting_is_checked_and_auto_means_the_models_dtype():
    assert EngineConfig(kv_cache_dtype="auto").kv_cache_dtype is None
    assert EngineConfig().resolve_kv_dtype(torch.float32, torch.device("cpu")) == torch.float32
    assert EngineConfig(kv_cache_dtype="float16").resolve_kv_dtype(torch.float32, torch.device("cpu")) == torch.float16
    # a gguf model's pool is float16 unless told otherwise, as llama.cpp's cache for the same file
    assert EngineConfig().resolve_kv_dtype(torch.float32, torch.device("cpu"), "gguf") == torch.float16
    assert EngineConfig(kv_cache_dtype="float32").resolve_kv_dtype(torch.float32, torch.device("cpu"),
                                                                   "gguf") == torch.float32
    assert EngineConfig().resolve_kv_dtype(torch.bfloat16, torch.device("cuda"), "gguf") == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="only the CPU kernels"):
        EngineConfig(kv_cache_dtype="float16").resolve_kv_dtype(torch.bfloat16, torch.device("cuda"))


def _engine(model, kv_cache_dtype=None, memory=2 << 20, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(kv_cache_memory=memory, block_size=4, kv_cache_dtype=kv_cache_dtype, **kw))


def test_a_float16_pool_holds_twice_the_blocks_and_the_models_kv_rounded(tiny_engine_model):
    full, half = _engine(tiny_engine_model), _engine(tiny_engine_model, "float16")
    assert full.kv_cache.dtype == torch.float32 and half.kv_cache.dtype == torch.float16
    assert half.num_blocks == 2 * full.num_blocks
    half = _engine(tiny_engine_model, "float16", memory=1 << 20)  # as many blocks as ``full``: the same ones used
    assert half.num_blocks == full.num_blocks
    full.kv_cache.zero_()
    half.kv_cache.zero_()
    prompt = [[(5 * j) % 250 + 3 for j in range(11)]]
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full.generate(prompt, once)
    half.generate(prompt, once)
    # layer 0's K/V come from the embeddings alone, so the float16 pool holds exactly the float32
    # pool's values rounded; later layers read the rounded past, so theirs are only close
    for layer in range(2):
        for a, b in zip(layer_views(full.kv_cache, layer), layer_views(half.kv_cache, layer)):
            assert a.abs().sum() > 0
            if layer == 0:
                assert torch.equal(b, a.to(torch.float16))
            else:
                torch.testing.assert_close(b.float(), a, atol=2e-2, rtol=1e-2)


def test_eager_and_compiled_decode_give_the_same_tokens_over_a_float16_pool(tiny_engine_model, tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("TANDEM_COMPILE_CACHE_DIR", str(tmp_path))
    eager = _engine(tiny_engine_model, "float16")
    compiled = _engine(tiny_engine_model, "float16", compile=True)
    prompts = [[(7 * i + 13 * j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(3)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    before = compiled.runner.compiled.num_steps
    assert compiled.generate(prompts, greedy) == eager.generate(prompts, greedy)
    assert compiled.runner.compiled.num_steps - before >= 9


def test_a_graph_traced_over_one_pool_dtype_is_not_loaded_for_another(tiny_engine_model):
    key = engine_artifact_key(tiny_engine_model, 16, 2)
    assert engine_artifact_key(tiny_engine_model, 16, 2, torch.float32) == key  # the model's own: as before
    assert engine_artifact_key(tiny_engine_model, 16, 2, torch.float16) != key
