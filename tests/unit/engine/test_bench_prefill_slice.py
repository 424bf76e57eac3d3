"""bench.prefill_slice's run: every online gap and batch prompt counted, and the slices show in how many
online tokens come while the batch runs (a tiny 4-layer model, the model's forward standing in for the
compiled step, the engine's clock 10 ms later at each look)."""

from __future__ import annotations

import argparse
import itertools
import random
import types

from loadtest.bench.prefill_slice import compare, run_once, summarize
from shared.engine import EngineConfig, LLMEngine
from shared.model.loader import load_model
from tiny_hf_models import save_tiny


def test_slices_give_the_online_streams_tokens_while_the_batch_runs_and_the_work_is_the_same(tmp_path):
    import torch

    save_tiny("llama", tmp_path, num_hidden_layers=4)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=4))
    engine.runner.use_compiled(types.SimpleNamespace(
        forward=lambda ids, pos, kv_cache, meta: model.forward(ids, pos, kv_cache, meta, engine.backend)))
    ticks = itertools.count()
    engine.slicer.clock = lambda: next(ticks) * 0.010
    args = argparse.Namespace(online=2, online_prompt_tokens=8, online_tokens=12, batch_prompts=3,
                              batch_prompt_tokens=40)
    runs = {s: run_once(engine, s, args, random.Random(0), f"s{s:g}") for s in (0.0, 15.0)}
    for run in runs.values():
        assert run["batch_prompts"] == 3 and run["online_tokens"] == 2 * (12 - 1) == len(run["itl_s"])
        assert 0 < run["batch_end_s"] <= run["makespan_s"]
    # without slices a stream gets a token per batch prompt's step; with them, one more between two slices
    assert len(runs[0.0]["itl_beside_s"]) == 2 * 3
    assert len(runs[15.0]["itl_beside_s"]) == 2 * 2 * 3
    pooled = {s: summarize([r]) for s, r in runs.items()}
    assert pooled[15.0]["beside_online_tokens"] == 12
    ratios = compare(pooled, 0.0)
    assert ratios[0.0]["makespan_s"] == 1.0 and ratios[15.0]["beside_online_tokens"] == 2.0
    assert engine.scheduler.has_unfinished is False and engine.runner.suspended is None
