"""Warm-up runs every path once, then measures the prefill rate admission predicts TTFT from on
warm kernels and a realistic length, so the first requests after ``ready`` are predicted: its own
short prompts on cold kernels are dropped (a rate kept from them had an idle worker's admission
reject every request for a TTFT it would have met)."""

from __future__ import annotations

import asyncio
import types

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.engine.async_engine import AsyncEngine
from shared.runtime import worker
from shared.runtime.worker import warm_up


def test_warm_up_leaves_the_rate_of_its_calibration_prompts_only(tiny_engine_model, monkeypatch):
    vocab = tiny_engine_model.cfg.vocab_size
    engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=16))
    engine.tokenizer = types.SimpleNamespace(vocab_size=vocab)  # all warm-up asks of one
    aengine = AsyncEngine(engine)
    monkeypatch.setattr(worker, "CALIBRATION_TOKENS", 64)
    observed: list[tuple[int, float]] = []
    engine.add_step_observer(lambda seqs, tokens, elapsed: observed.append((tokens, elapsed)))
    forgotten: list[int] = []
    forget = engine.forget_prefill_rate
    engine.forget_prefill_rate = lambda: (forgotten.append(len(observed)), forget())[1]
    measured: list[float | None] = []

    async def run() -> None:
        await warm_up(aengine, "w", 4)
        measured.append(aengine.stats().prefill_tokens_per_s)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in aengine.generate("real", [(5 + 3 * j) % vocab for j in range(48)], params):
            pass
        measured.append(aengine.stats().prefill_tokens_per_s)

    try:
        assert engine.stats().prefill_tokens_per_s is None
        asyncio.run(run())
    finally:
        aengine.shutdown()
    # dropped once, just before the last calibration prompt: the rate is that prompt's alone
    assert len(forgotten) == 1
    after_forget = [(tokens, s) for tokens, s in observed[forgotten[0]:] if tokens >= 16]
    assert after_forget[0][0] == 64
    after_warm_up, after_request = measured
    assert after_warm_up == 64 / after_forget[0][1]
    assert after_request is not None and after_request > 0


def test_no_warm_up_no_rate(tiny_engine_model):
    engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=16))
    aengine = AsyncEngine(engine)
    try:
        asyncio.run(warm_up(aengine, "w", 0))
        assert aengine.stats().prefill_tokens_per_s is None
    finally:
        aengine.shutdown()
