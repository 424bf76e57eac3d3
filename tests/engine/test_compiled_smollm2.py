"""The compiled decode step on the real SmolLM2 (float32, where eager matches transformers):
the same greedy tokens as the eager step, alone and in a ragged batch."""

import pytest

from shared.engine import SamplingParams

# a cold compile of SmolLM2's step takes 5-7 minutes on a 2-core machine (more on a busy one): a
# slow compile is not a hang
pytestmark = [pytest.mark.timeout(1500), pytest.mark.long]


def test_compiled_decode_gives_the_eager_greedy_text(make_engine, chat_prompts):
    """Over a minute where the compile cache is cold: the compiled engine builds its decode step first."""
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


def test_background_compile_answers_at_once_and_keeps_the_greedy_text(make_engine, chat_prompts):
    """The workers' default: eager steps answer while a thread compiles; after the hand-over the
    decode steps run compiled, and the greedy text is the eager one throughout."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    expected = make_engine(dtype="float32").generate(chat_prompts[:2], greedy)
    engine = make_engine(dtype="float32", compile="background")
    # "compiled" already if this process compiled the same graph before (the test above)
    assert engine.stats().decode_step in ("compiling", "compiled")
    assert engine.generate(chat_prompts[:2], greedy) == expected  # while compiling (or just after)
    assert engine.background_compile.wait(timeout=900) and engine.background_compile.error is None
    assert engine.stats().decode_step == "compiled"
    steps = engine.runner.compiled.num_steps
    assert engine.generate(chat_prompts[:2], greedy) == expected
    # every token after each request's first came from a compiled step (the two share steps)
    assert engine.runner.compiled.num_steps - steps >= max(map(len, expected)) - 1 > 5
    engine.kv.check_integrity()


def test_default_precision_greedy_tokens_hold_in_a_batch_beside_a_prefill_and_after_a_move(chat_prompts):
    """The workers' default (int8 layers on a CPU with VNNI, the compiled step): a greedy request's
    tokens are the same alone, among batch-mates, beside another request's chunked prefill, and
    when it moves to another engine after 15 tokens and recomputes them there."""
    from shared.engine import EngineConfig, LLMEngine

    config = EngineConfig(model="smollm2-135m", device="cpu", compile="on", kv_cache_memory=64 << 20,
                          max_num_batched_tokens=64, enable_prefix_caching=False)
    engine = LLMEngine.from_config(config)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    short = [chat_prompts[i] for i in (0, 2, 4)]
    alone = [engine.generate([p], greedy)[0] for p in short]
    assert engine.generate(short, greedy) == alone
    beside = engine.generate(short + [chat_prompts[3]], greedy)  # its ~250 tokens prefill in chunks of 64
    assert beside[:3] == alone
    assert engine.runner.compiled.num_steps > 3 * 39
    other = LLMEngine.from_config(config)  # another worker
    moved = SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True, num_output_in_prompt=15)
    assert [other.generate([p + out[:15]], moved)[0] for p, out in zip(short, alone)] == [out[15:] for out in alone]


def test_default_precision_greedy_tokens_hold_after_a_move_from_an_eager_worker_to_a_compiled_one(chat_prompts):
    """A request decoding on a worker still eager (its compile not handed over) moves after 15
    tokens to one that runs compiled, told the path it had (``decode_path``, as the gateway sends
    it): the new worker recomputes and continues it eagerly, and its tokens are those it would
    have had without moving (default precision: int8 layers)."""
    import dataclasses

    from shared.engine import EngineConfig, LLMEngine

    config = EngineConfig(model="smollm2-135m", device="cpu", compile="off", kv_cache_memory=64 << 20,
                          enable_prefix_caching=False)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    short = [chat_prompts[i] for i in (0, 2, 4)]
    eager = LLMEngine.from_config(config)
    alone = [eager.generate([p], greedy)[0] for p in short]
    compiled = LLMEngine.from_config(dataclasses.replace(config, compile="on"))
    moved = SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True, num_output_in_prompt=15,
                           decode_path="eager")
    assert [compiled.generate([p + out[:15]], moved)[0] for p, out in zip(short, alone)] == [out[15:] for out in alone]
    assert compiled.runner.compiled.num_steps == 0  # every decode row ran eagerly
