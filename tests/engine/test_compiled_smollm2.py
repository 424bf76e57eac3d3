"""The compiled decode step on the real SmolLM2 (float32, where eager matches transformers):
the same greedy tokens as the eager step, alone and in a ragged batch."""

from shared.engine import SamplingParams


def test_compiled_decode_gives_the_eager_greedy_text(make_engine, chat_prompts):
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    eager = make_engine(dtype="float32")
    compiled = make_engine(dtype="float32", compile=True)
    alone = compiled.generate(chat_prompts[:1], greedy)
    assert alone == eager.generate(chat_prompts[:1], greedy)
    together = compiled.generate(chat_prompts[:3], greedy)  # ragged lengths
    assert together == eager.generate(chat_prompts[:3], greedy)
    # every token after a request's first came from a compiled step (batch-mates share steps)
    assert compiled.runner.compiled.num_steps >= max(map(len, alone)) - 1 + max(map(len, together)) - 1 > 30
    compiled.kv.check_integrity()
