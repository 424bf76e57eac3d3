"""Speculative decoding on the real SmolLM2 (float32): on an editing workload (the answer mostly
repeats the prompt) a good share of the drafts is accepted, and greedy text is the same token for token as
without speculation, alone and in a batch; sampled requests still run (their distribution is
checked on a tiny model in tests/unit/engine/test_speculative.py)."""

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
