"""The engine on the real default model, checked token for token against transformers."""

import asyncio

import pytest
import torch

from shared.engine import AsyncEngine, PromptTooLongError, SamplingParams

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def reference(hf_smol, chat_prompts, smol_tokenizer):
    """transformers' greedy continuation of each prompt, cut after the first stop token."""
    refs = []
    for prompt in chat_prompts:
        with torch.no_grad():
            out = hf_smol.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                   eos_token_id=list(smol_tokenizer.stop_token_ids))
        refs.append(out[0, len(prompt):].tolist())
    return refs


@torch.no_grad()
def hf_greedy_ignoring_eos(model, prompt, n):
    """transformers' greedy decoding (with its KV cache), running past end-of-turn tokens."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(n - 1):
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def assert_all_blocks_free(engine):
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    engine.kv.check_integrity()


def test_batched_greedy_equals_transformers(make_engine, chat_prompts, reference):
    engine = make_engine()
    assert engine.generate(chat_prompts, GREEDY) == reference
    assert_all_blocks_free(engine)


def test_equal_again_with_a_warm_prefix_cache(make_engine, chat_prompts, reference):
    engine = make_engine()
    engine.generate(chat_prompts, GREEDY)
    stats_before = engine.stats()
    assert engine.generate(chat_prompts, GREEDY) == reference
    stats = engine.stats()
    cached = stats.num_cached_prompt_tokens - stats_before.num_cached_prompt_tokens
    # every prompt shares the 30-token system prompt; repeated prompts hit all but their last block
    assert cached >= sum((len(p) - 1) // 16 * 16 for p in chat_prompts)
    assert_all_blocks_free(engine)


def test_equal_with_a_tiny_chunked_prefill_budget(make_engine, chat_prompts, reference):
    engine = make_engine(max_num_batched_tokens=16, block_size=32)
    assert engine.generate(chat_prompts, GREEDY) == reference
    assert engine.stats().num_steps > sum(len(p) for p in chat_prompts) // 16
    assert_all_blocks_free(engine)


def test_equal_through_forced_preemption(make_engine, chat_prompts, hf_smol):
    prompts = [chat_prompts[i] for i in (0, 2, 4)]  # ~40 tokens each, growing past 80
    n = 48
    reference = [hf_greedy_ignoring_eos(hf_smol, p, n) for p in prompts]
    per_block = 30 * 2 * 3 * 64 * 4 * 16  # SmolLM2 fp32: 720 KiB per 16-token block
    engine = make_engine(kv_cache_memory=per_block * 11)  # the three need 18 blocks at the end
    got = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    assert engine.stats().num_preemptions > 0
    assert got == reference
    assert_all_blocks_free(engine)


def test_abort_mid_generation_returns_every_block(make_engine, chat_prompts):
    engine = make_engine()
    for i, p in enumerate(chat_prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.kv.pool.num_used_blocks > 0
    for i in range(len(chat_prompts)):
        out = engine.abort_request(f"r{i}")
        assert out.finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_seeded_sampling_is_reproducible_in_different_batches(make_engine, chat_prompts):
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    alone = make_engine().generate([chat_prompts[2]], seeded)[0]
    mixed = make_engine().generate(
        [chat_prompts[0], chat_prompts[2], chat_prompts[3]],
        [SamplingParams(max_tokens=16, temperature=1.0), seeded, SamplingParams(max_tokens=8, temperature=0.5)])[1]
    assert alone == mixed
    other = make_engine().generate([chat_prompts[2]], SamplingParams(**{**vars(seeded), "seed": 7}))[0]
    assert other != alone


def test_top_k_1_equals_greedy(make_engine, chat_prompts, reference):
    engine = make_engine()
    out = engine.generate(chat_prompts[:3], SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_k=1))
    assert out == reference[:3]


def test_stop_on_end_of_turn_and_length(make_engine, chat_prompts, smol_tokenizer):
    engine = make_engine()
    engine.add_request("a", chat_prompts[0], SamplingParams(max_tokens=64, temperature=0.0))
    engine.add_request("b", chat_prompts[2], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finish_reason:
                finals[o.request_id] = o
    assert finals["a"].finish_reason == "stop" and finals["b"].finish_reason == "length"
    assert finals["b"].num_output_tokens == 5


def test_prompt_longer_than_the_context_is_rejected(make_engine):
    engine = make_engine(max_model_len=64)
    with pytest.raises(PromptTooLongError, match="64"):
        engine.add_request("x", list(range(100)), GREEDY)
    assert not engine.has_unfinished_requests()


async def test_async_engine_streams_and_abort_frees_blocks(make_engine, chat_prompts, reference):
    engine = make_engine()
    aengine = AsyncEngine(engine)
    try:
        async def collect(i):
            return [t for o in [o async for o in aengine.generate(f"g{i}", chat_prompts[i], GREEDY)]
                    for t in o.new_token_ids]

        async def abandon():
            async for o in aengine.generate("gone", chat_prompts[3], SamplingParams(max_tokens=500, ignore_eos=True)):
                if o.num_output_tokens >= 3:
                    break  # leaving the stream aborts the request

        results = await asyncio.gather(collect(0), collect(1), abandon(), collect(2))
        assert [results[0], results[1], results[3]] == reference[:3]
        for _ in range(200):  # the abort is applied by the engine thread
            if aengine.stats().num_blocks_used == 0 and aengine.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert aengine.stats().num_blocks_used == 0
        with pytest.raises(PromptTooLongError):
            [o async for o in aengine.generate("long", list(range(9000)), GREEDY)]
    finally:
        aengine.shutdown()
    assert_all_blocks_free(engine)



async def test_async_engine_takes_the_threads_its_creator_gives_up(make_engine, chat_prompts, reference):
    """shared/engine/cpu_threads.py on the real model: the engine thread steps with the process's
    intra-op threads, the creating thread keeps one until shutdown, and the greedy text is the
    reference's."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        aengine = AsyncEngine(make_engine())
        try:
            assert torch.get_num_threads() == 1
            assert await aengine.call(lambda engine: torch.get_num_threads()) == 2
            tokens = [t async for o in aengine.generate("t0", chat_prompts[0], GREEDY) for t in o.new_token_ids]
            assert tokens == reference[0]
        finally:
            aengine.shutdown()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
