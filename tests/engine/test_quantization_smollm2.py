"""Int8 (W8A8) linear layers on the real SmolLM2: how far they move the model, and that they stay
batch-independent and usable from the CLI."""

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.model.loader import load_model
from shared.model.quant import EVAL_PASSAGE, calibration_token_ids, compare_models

@pytest.fixture(scope="module")
def float_and_int8(smollm2_gguf, smol_model, smol_tokenizer):
    cpu = torch.device("cpu")
    fp32 = smol_model  # the session's float32 model, left as it is
    smooth = load_model(smollm2_gguf, "gguf", cpu, torch.float32)
    smooth.quantize("int8", calibration_token_ids(smol_tokenizer))
    plain = load_model(smollm2_gguf, "gguf", cpu, torch.float32)
    plain.quantize("int8")  # no calibration: no smoothing
    return fp32, smooth, plain


def test_int8_stays_close_to_float32(float_and_int8, smol_tokenizer):
    fp32, smooth, plain = float_and_int8
    ids = smol_tokenizer.encode(EVAL_PASSAGE)
    got, unsmoothed = compare_models(fp32, smooth, ids), compare_models(fp32, plain, ids)
    print(got, "unsmoothed KL", unsmoothed["kl"])
    assert got["top1_agreement"] >= 0.85
    assert got["perplexity"] <= 1.10 * got["perplexity_reference"]
    assert got["kl"] < 0.05
    assert got["kl"] < unsmoothed["kl"]  # the calibration's smoothing helps


def test_int8_greedy_is_batch_independent_and_answers(float_and_int8, smol_tokenizer, chat_prompts):
    _, smooth, _ = float_and_int8
    engine = LLMEngine(smooth, EngineConfig(kv_cache_memory=64 << 20, quantization="int8", max_num_batched_tokens=64),
                       tokenizer=smol_tokenizer, eos_token_ids=frozenset(smol_tokenizer.stop_token_ids))
    params = SamplingParams(max_tokens=16, temperature=0.0)
    together = engine.generate(chat_prompts, params)  # mixed lengths, chunked prefill mixed with decodes
    alone = [engine.generate([p], params)[0] for p in chat_prompts]
    assert together == alone
    # chat_prompts[0] asks "What is the capital of France?", where float32's first token leads by
    # 0.08 logits only, inside int8's noise: ask with a clear margin (1.4) whether it still answers
    named = smol_tokenizer.encode(smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name the capital of France."}]))
    assert "Paris" in smol_tokenizer.decode(engine.generate([named], params)[0])
    assert engine.kv.pool.num_free_blocks == engine.num_blocks


def test_int8_precise_agrees_with_float32_more_and_stays_batch_independent(float_and_int8, smollm2_gguf,
                                                                          smol_tokenizer, chat_prompts):
    """Two int8 levels for the activations and the LM head's weights: closer to float32 than int8's
    one level on the held-out passage, and still a row's output alone or in any batch."""
    fp32, smooth, _ = float_and_int8
    precise = load_model(smollm2_gguf, "gguf", torch.device("cpu"), torch.float32)
    precise.quantize("int8-precise")
    assert precise.quantization == "int8-precise" and smooth.quantization == "int8"
    ids = smol_tokenizer.encode(EVAL_PASSAGE)
    got, one_level = compare_models(fp32, precise, ids), compare_models(fp32, smooth, ids)
    print(got, "int8:", one_level)
    assert got["top1_agreement"] >= 0.95
    assert got["kl"] < one_level["kl"] / 2
    engine = LLMEngine(precise, EngineConfig(kv_cache_memory=64 << 20, quantization="int8-precise",
                                             max_num_batched_tokens=64),
                       tokenizer=smol_tokenizer, eos_token_ids=frozenset(smol_tokenizer.stop_token_ids))
    params = SamplingParams(max_tokens=16, temperature=0.0)
    together = engine.generate(chat_prompts, params)
    assert together == [engine.generate([p], params)[0] for p in chat_prompts]


def test_gguf_blocks_keep_the_files_4_bit_layers_and_stay_close_and_batch_independent(
        smol_model, smollm2_gguf, smol_tokenizer, chat_prompts):
    """``--quantization gguf`` on the real file (Q4_1 layers, a Q8_0 embedding the LM head shares):
    every decoder layer is kept on its own 4-bit grid, the LM head in 8-bit blocks; it stays close
    to float32 of the same file, and a row's output does not depend on its batch-mates."""
    from shared.model.quant import BlockWeight

    fp32 = smol_model
    blocks = load_model(smollm2_gguf, "gguf", torch.device("cpu"), torch.float32)
    blocks.quantize("gguf")
    assert blocks.quantization == "gguf"
    layer_weights = [getattr(layer, n) for layer in blocks.layers for n in ("qkv", "o_proj", "gate_up", "down")]
    assert all(isinstance(w, BlockWeight) and w.bits == 4 for w in layer_weights)
    assert isinstance(blocks.lm_head, BlockWeight) and blocks.lm_head.bits == 8
    got = compare_models(fp32, blocks, smol_tokenizer.encode(EVAL_PASSAGE))
    print(got)
    assert got["top1_agreement"] >= 0.95
    assert got["kl"] < 0.005
    engine = LLMEngine(blocks, EngineConfig(kv_cache_memory=64 << 20, quantization="gguf", max_num_batched_tokens=64),
                       tokenizer=smol_tokenizer, eos_token_ids=frozenset(smol_tokenizer.stop_token_ids))
    params = SamplingParams(max_tokens=16, temperature=0.0)
    together = engine.generate(chat_prompts, params)  # chunked prefills beside decodes
    assert together == [engine.generate([p], params)[0] for p in chat_prompts]
    named = smol_tokenizer.encode(smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name the capital of France."}]))
    assert "Paris" in smol_tokenizer.decode(engine.generate([named], params)[0])
