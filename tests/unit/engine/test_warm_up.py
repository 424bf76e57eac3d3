"""Warm-up runs every path once, then forgets the prefill rate it measured: its few short prompts on
cold kernels are not the worker's speed, and admission predicts TTFT from that rate (a rate kept
from warm-up had an idle worker's admission reject every request for a TTFT it would have met)."""

from __future__ import annotations

import asyncio
import types

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.engine.async_engine import AsyncEngine
from shared.worker.engine_worker import warm_up


def test_warm_up_does_not_leave_its_prefill_rate_behind(tiny_engine_model):
    vocab = tiny_engine_model.cfg.vocab_size
    engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=16))
    engine.tokenizer = types.SimpleNamespace(vocab_size=vocab)  # all warm-up asks of one
    aengine = AsyncEngine(engine)
    measured: list[float | None] = []

    async def run() -> None:
        await warm_up(aengine, "w", 4)
        measured.append(aengine.stats().prefill_tokens_per_s)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in aengine.generate("real", [(5 + 3 * j) % vocab for j in range(48)], params):
            pass
        measured.append(aengine.stats().prefill_tokens_per_s)

    try:
        # the warm-up's prompts (8 to 80 tokens) are long enough to be measured...
        assert engine.stats().prefill_tokens_per_s is None
        asyncio.run(run())
    finally:
        aengine.shutdown()
    after_warm_up, after_request = measured
    assert after_warm_up is None           # ...and are forgotten
    assert after_request is not None and after_request > 0
