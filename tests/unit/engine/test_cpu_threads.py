"""The engine thread owns the intra-op threads (shared/engine/cpu_threads.py): once an AsyncEngine
runs, its thread steps with the configured count, the thread that created it runs on one thread,
and shutting the engine down from that thread gives the count back."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine
from shared.engine.async_engine import AsyncEngine
from shared.engine.cpu_threads import _openmp_library


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def engine_thread_count(aengine: AsyncEngine) -> int:
    return asyncio.run(aengine.call(lambda engine: torch.get_num_threads()))


@pytest.mark.parametrize("configured", [None, 1])
def test_engine_thread_takes_the_threads_and_the_creator_gives_them_up(tiny_engine_model, two_threads, configured):
    engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=2 << 20, num_threads=configured))
    aengine = AsyncEngine(engine)
    try:
        assert torch.get_num_threads() == 1  # this (the creating) thread
        assert engine_thread_count(aengine) == (configured or 2)
    finally:
        aengine.shutdown()
    assert torch.get_num_threads() == 2


def test_the_openmp_runtime_is_found():
    if torch.__config__.parallel_info().find("OpenMP") < 0:
        pytest.skip("torch built without OpenMP")
    assert _openmp_library() is not None
