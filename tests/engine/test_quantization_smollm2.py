"""Int8 (W8A8) linear layers on the real SmolLM2: how far they move the model, and that they stay
batch-independent and usable from the CLI."""

import math

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.model.loader import load_model
from shared.model.quant import calibration_token_ids

PASSAGE = (
    "The lighthouse stood at the end of a narrow spit of rock, and for more than a century its keepers had "
    "climbed the one hundred and twelve steps every evening to light the lamp. In the winter of 1911 the "
    "storms came early. Ships that had left the harbour in October were still missing in December, and the "
    "village waited for news that did not come. The keeper's daughter, who was eleven, kept a notebook in "
    "which she wrote the direction of the wind, the height of the waves and the names of the boats she saw. "
    "Years later a historian found the notebook in a box of old tide tables and used it to work out where "
    "the missing ships had most likely gone down. Her careful entries, written in pencil by the light of the "
    "great lamp, turned out to be more accurate than the official records kept in the harbour office. "
    "Today the lighthouse is automatic, and the notebook is on display in the small museum beside the pier."
)


@pytest.fixture(scope="module")
def float_and_int8(smollm2_gguf, smol_tokenizer):
    cpu = torch.device("cpu")
    fp32 = load_model(smollm2_gguf, "gguf", cpu, torch.float32)
    smooth = load_model(smollm2_gguf, "gguf", cpu, torch.float32)
    smooth.quantize("int8", calibration_token_ids(smol_tokenizer))
    plain = load_model(smollm2_gguf, "gguf", cpu, torch.float32)
    plain.quantize("int8")  # no calibration: no smoothing
    return fp32, smooth, plain


def test_int8_stays_close_to_float32(float_and_int8, smol_tokenizer):
    fp32, smooth, plain = float_and_int8
    ids = smol_tokenizer.encode(PASSAGE)
    ref, got, unsmoothed = (m.prefill_logits(ids).log_softmax(-1) for m in (fp32, smooth, plain))
    target = torch.tensor(ids[1:])

    def ppl(lp):
        return math.exp(-float(lp[:-1].gather(1, target[:, None]).mean()))

    def kl(lp):
        return float((ref.exp() * (ref - lp)).sum(-1).mean())

    agree = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    print(f"top-1 agreement {agree:.3f}, KL {kl(got):.4f} (unsmoothed {kl(unsmoothed):.4f}), "
          f"perplexity {ppl(ref):.2f} -> {ppl(got):.2f}")
    assert agree >= 0.85
    assert ppl(got) <= 1.10 * ppl(ref)
    assert kl(got) < 0.05
    assert kl(got) < kl(unsmoothed)  # the calibration's smoothing helps


def test_int8_greedy_is_batch_independent_and_answers(float_and_int8, smol_tokenizer, chat_prompts):
    _, smooth, _ = float_and_int8
    engine = LLMEngine(smooth, EngineConfig(kv_cache_memory=64 << 20, quantization="int8", max_num_batched_tokens=64),
                       tokenizer=smol_tokenizer, eos_token_ids=frozenset(smol_tokenizer.stop_token_ids))
    params = SamplingParams(max_tokens=16, temperature=0.0)
    together = engine.generate(chat_prompts, params)  # mixed lengths, chunked prefill mixed with decodes
    alone = [engine.generate([p], params)[0] for p in chat_prompts]
    assert together == alone
    assert "Paris" in smol_tokenizer.decode(together[0])
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
