"""Speculative decoding on the real SmolLM2 (float32): on an editing workload (the answer mostly
repeats the prompt) a good share of the drafts is accepted, and greedy text is the same token for token as
without speculation, alone and in a batch; sampled requests still run (their distribution is
checked on a tiny model in tests/unit/engine/test_speculative.py); at the default precision too,
eager and compiled."""

import dataclasses

import pytest
import torch

from shared.engine import SamplingParams

CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(vaules)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)
'''
EDITS = [
    "Fix the typo in this Python code and print the whole corrected code:\n\n" + CODE,
    "Rewrite this sentence exactly, but in the past tense: The engineer opens the valve, the steam pushes the "
    "piston, and the wheel turns faster while the train climbs the hill.",
]


def chat(tokenizer, text):
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def test_greedy_text_is_identical_with_speculation_and_drafts_are_accepted(make_engine, smol_tokenizer):
    prompts = [chat(smol_tokenizer, text) for text in EDITS]
    greedy = SamplingParams(max_tokens=64, temperature=0.0)
    plain = make_engine(dtype="float32")
    spec = make_engine(dtype="float32", speculative_tokens=6)
    assert spec.generate(prompts[:1], greedy) == plain.generate(prompts[:1], greedy)  # alone
    assert spec.generate(prompts, greedy) == plain.generate(prompts, greedy)  # together
    stats = spec.stats()
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0
    assert stats.num_steps < plain.stats().num_steps
    spec.kv.check_integrity()


def test_sampled_requests_speculate_and_finish(make_engine, smol_tokenizer):
    spec = make_engine(dtype="float32", speculative_tokens=6)
    prompt = chat(smol_tokenizer, EDITS[0])
    outs = spec.generate([prompt] * 2, SamplingParams(max_tokens=32, temperature=0.7, top_p=0.95))
    assert all(0 < len(o) <= 32 for o in outs)
    assert spec.stats().num_draft_tokens > 0
    spec.kv.check_integrity()
    assert spec.kv.pool.num_free_blocks == spec.kv.pool.num_blocks


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_default_precision_greedy_text_is_identical_with_speculation(smol_tokenizer, compile_mode, record_logits):
    """The default precision, eager and with the compiled decode step: a verified draft token is
    computed as a decode row at its position would be, so the greedy text is the same token for
    token with speculation on or off, alone and together. With int8 layers (the default where the
    CPU has VNNI) every sum in a row is exact, so its logits are bit for bit plain decoding's. In
    float32 (the default without VNNI or bf16: AVX2 only, e.g. AMD Zen 3) the verify step's
    matmuls have a draft's rows where a decode step has one, and MKL sums them in another order:
    the logits agree to float32 rounding, not to the bit. With the compiled step and a cold compile
    cache (a fresh machine) it takes over a minute: the compile is part of it."""
    from shared.engine import EngineConfig, LLMEngine

    config = EngineConfig(model="smollm2-135m", device="cpu", compile=compile_mode, kv_cache_memory=64 << 20)
    plain = LLMEngine.from_config(config)
    spec = LLMEngine.from_config(dataclasses.replace(config, speculative_tokens=6))
    prompts = [chat(smol_tokenizer, text) for text in EDITS]
    greedy = SamplingParams(max_tokens=64, temperature=0.0)
    assert spec.generate(prompts[:1], greedy) == plain.generate(prompts[:1], greedy)
    plain_logits, spec_logits = record_logits(plain), record_logits(spec)
    assert spec.generate(prompts, greedy) == plain.generate(prompts, greedy)
    stats = spec.stats()
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0
    # every position plain decoding sampled (a verified draft may run past the stop token: not used)
    assert plain_logits.keys() <= spec_logits.keys()
    if plain.model.quantization != "none":
        assert all(torch.equal(spec_logits[key], row) for key, row in plain_logits.items())
    else:
        worst = max((spec_logits[key] - row).abs().max().item() for key, row in plain_logits.items())
        assert worst < 1e-3, f"verified drafts' logits differ from plain decoding's by up to {worst}"
    if compile_mode == "on":
        assert stats.decode_step == "compiled" and spec.runner.compiled.num_steps > 0
    spec.kv.check_integrity()
