"""Warm-up runs every path once, then measures the prefill rate on warm kernels with a long prompt
alone and keeps it apart (``warmup_prefill_tokens_per_s``): admission's rate until real prompts
measure one. The rate measured on its few short prompts on cold kernels is forgotten: it is not
the worker's speed (a rate kept from those had an idle worker's admission reject every request
for a TTFT it would have met), and the measured rate starts afresh with real prompts."""

from __future__ import annotations

import asyncio
import types

import pytest

from services.worker.engine_worker import warm_up
from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.engine.async_engine import AsyncEngine


@pytest.mark.parametrize("measure_rate", [True, False])
def test_warm_up_keeps_its_measured_rate_apart_and_real_prompts_measure_afresh(tiny_engine_model, measure_rate):
    vocab = tiny_engine_model.cfg.vocab_size
    engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=16))
    engine.tokenizer = types.SimpleNamespace(vocab_size=vocab)  # all warm-up asks of one
    aengine = AsyncEngine(engine)
    measured: list = []

    async def run() -> None:
        await warm_up(aengine, "w", 4, measure_rate)
        stats = aengine.stats()
        measured.append((stats.prefill_tokens_per_s, stats.warmup_prefill_tokens_per_s))
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in aengine.generate("real", [(5 + 3 * j) % vocab for j in range(48)], params):
            pass
        stats = aengine.stats()
        measured.append((stats.prefill_tokens_per_s, stats.warmup_prefill_tokens_per_s))

    try:
        assert engine.stats().prefill_tokens_per_s is None
        asyncio.run(run())
    finally:
        aengine.shutdown()
    (after_warm_up, warmup_rate), (after_request, warmup_rate_later) = measured
    assert after_warm_up is None  # warm-up's own prompts are forgotten
    assert after_request is not None and after_request > 0
    if measure_rate:
        assert warmup_rate is not None and warmup_rate > 0 and warmup_rate_later == warmup_rate
    else:
        assert warmup_rate is None and warmup_rate_later is None


def test_a_request_posted_during_a_step_counts_as_waiting_before_the_next_snapshot(tiny_engine_model):
    """Load reports read ``AsyncEngine.stats()``: a request the engine thread has not taken in yet
    (it runs a step meanwhile) must show as waiting, at its priority, with its prompt to prefill."""
    import threading

    vocab = tiny_engine_model.cfg.vocab_size
    aengine = AsyncEngine(LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=16)))
    release = threading.Event()
    seen: list = []

    async def run() -> None:
        busy = asyncio.ensure_future(aengine.call(lambda e: release.wait(10)))  # the engine thread is busy
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

        async def one() -> None:
            async for _ in aengine.generate("late", [(5 + 3 * j) % vocab for j in range(40)], params, priority=2):
                pass

        task = asyncio.ensure_future(one())
        for _ in range(1000):  # until the request is posted (the engine thread stays busy meanwhile)
            if (stats := aengine.stats()).num_waiting:
                break
            await asyncio.sleep(0)
        seen.append((stats.num_waiting, stats.num_waiting_by_priority, stats.queued_prefill_tokens))
        release.set()
        await busy
        await task
        stats = aengine.stats()
        seen.append((stats.num_waiting, stats.num_waiting_by_priority, stats.queued_prefill_tokens))

    try:
        asyncio.run(run())
    finally:
        aengine.shutdown()
    assert seen[0] == (1, {2: 1}, {2: 40})
    assert seen[1][0] == 0 and not seen[1][1].get(2) and not seen[1][2].get(2)
