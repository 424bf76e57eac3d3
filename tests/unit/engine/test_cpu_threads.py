"""The engine thread owns the intra-op threads (shared/engine/cpu_threads.py): once an AsyncEngine
runs, its thread steps with the configured count, the thread that created it runs on one thread,
and shutting the engine down from that thread gives the count back."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine, cpu_threads
from shared.engine.async_engine import AsyncEngine
from shared.engine.cpu_threads import _openmp_library
from shared.process_settings import InvalidSetting


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


def test_the_creator_drops_to_one_thread_without_torch_set_num_threads(tiny_engine_model, two_threads, monkeypatch):
    """torch.set_num_threads(1) in the creating thread slowed the engine thread's steps (a compiled
    batch-1 step of a 1B model: 250 ms against 135 ms; it sets more than the calling thread's
    OpenMP count): the drop goes through the OpenMP runtime's omp_set_num_threads alone."""
    if _openmp_library() is None:
        pytest.skip("no OpenMP runtime loaded")
    creator = threading.get_ident()
    calls = []
    set_num_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append((threading.get_ident(), n)),
                                                             set_num_threads(n))[1])
    engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=2 << 20))
    aengine = AsyncEngine(engine)
    try:
        assert torch.get_num_threads() == 1
        assert engine_thread_count(aengine) == 2
        assert [n for thread, n in calls if thread == creator] == []
    finally:
        aengine.shutdown()
    assert torch.get_num_threads() == 2


def test_the_openmp_runtime_is_found():
    if torch.__config__.parallel_info().find("OpenMP") < 0:
        pytest.skip("torch built without OpenMP")
    assert _openmp_library() is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice per thread is Linux's")
def test_background_work_runs_at_the_lowest_priority_and_only_that_thread(monkeypatch):
    seen = {}

    def work():
        seen["lowered"] = cpu_threads.lower_calling_thread(cpu_threads.background_nice())
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        child = subprocess.run(["sh", "-c", "cut -d' ' -f19 /proc/self/stat"], capture_output=True, text=True)
        seen["child"] = int(child.stdout)  # a process it starts inherits the nice value

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    monkeypatch.delenv("TANDEM_COMPILE_NICE", raising=False)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == {"lowered": True, "nice": 19, "child": 19}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the caller's own thread only
    monkeypatch.setenv("TANDEM_COMPILE_NICE", "0")
    assert cpu_threads.background_nice() == 0 and not cpu_threads.lower_calling_thread(0)
    monkeypatch.setenv("TANDEM_COMPILE_NICE", "high")
    with pytest.raises(InvalidSetting, match="TANDEM_COMPILE_NICE='high'"):
        cpu_threads.background_nice()
