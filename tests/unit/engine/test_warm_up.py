"""Warm-up runs every path once, then measures the prefill rate on warm kernels with a long prompt
alone and keeps it apart (``warmup_prefill_tokens_per_s``): admission's rate until real prompts
measure one. The rate measured on its few short prompts on cold kernels is forgotten: it is not
the worker's speed (a rate kept from those had an idle worker's admission reject every request
for a TTFT it would have met), and the measured rate starts afresh with real prompts."""

from __future__ import annotations

import asyncio
import types

import pytest

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.engine.async_engine import AsyncEngine
from shared.worker.engine_worker import warm_up


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
