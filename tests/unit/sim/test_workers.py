"""The simulated decode worker's timeline: a local prefill waits for the decode step in progress."""

from __future__ import annotations

import pytest

from shared.planner.config import MODEL_PRESETS, GpuType
from shared.planner.costmodel import Efficiency, GroupHardware, Parallel
from shared.sim.workers import DECODE, Worker

MODEL = MODEL_PRESETS["smollm2-135m"]
GPU = GpuType(tflops_bf16=100.0, hbm_gib=16.0, hbm_gbps=1000.0, price_per_hour=0.0)
HW = GroupHardware(gpu=GPU, tp_link_gbps=100.0, pp_link_gbps=100.0, price_per_hour=0.0)


def worker() -> Worker:
    return Worker(0, "w", DECODE, [0], HW, None, Parallel(1, 1), MODEL, Efficiency(), 16)


def test_an_idle_worker_prefills_at_once():
    w = worker()
    assert w.stall(1.0, 0.2) == pytest.approx(1.2)


def test_a_prefill_waits_for_the_running_step_and_that_step_completes():
    w = worker()
    w.join(0.0, request=1, steps=100, ctx=64)
    w.next_finish(0.0)
    step = w.step_time
    assert step > 0
    # 2.25 steps in: the third step finishes first, then the prefill runs with decoding paused
    end = w.stall(2.25 * step, 0.5)
    assert end == pytest.approx(3 * step + 0.5)
    assert w.steps_done == pytest.approx(3.0)
    w.advance(end + 2 * step)
    assert w.steps_done == pytest.approx(5.0)


def test_a_prefill_at_a_step_boundary_or_behind_another_does_not_wait_more():
    w = worker()
    w.join(0.0, request=1, steps=100, ctx=64)
    w.next_finish(0.0)
    step = w.step_time
    assert w.stall(2 * step, 0.5) == pytest.approx(2 * step + 0.5)
    # a second prompt during the first prefill queues behind it, not behind a decode step
    assert w.stall(2 * step + 0.1, 0.3) == pytest.approx(2 * step + 0.8)


def test_the_prefix_cache_is_the_pools_free_part_unless_it_is_a_cache_of_its_own():
    w = worker()
    w.cache_blocks = 10
    index: dict[int, set[int]] = {}
    w.cache_insert(list(range(8)), index)
    assert len(w.cache) == 8
    # a running request holding 6 blocks that are not cached (its output, say) leaves room for 4:
    # the least recently used blocks go, and kv-index forgets this worker had them
    w.kv_used = 6 * 16
    w.cache_insert([100], index)
    assert list(w.cache) == [5, 6, 7, 100] and 0 not in index and index[100] == {0}
    # its whole prompt blocks are cache blocks once prefilled: they take no room twice
    w.running_cached_blocks = 6
    w.cache_insert([101, 102, 103, 104, 105, 106], index)
    assert len(w.cache) == 10
    # a cache of its own (a host tier of prefix_cache_blocks) is not shrunk by running requests
    w.cache_shares_pool, w.running_cached_blocks, w.kv_used = False, 0, 9 * 16
    w.cache_insert([200], index)
    assert len(w.cache) == 10 and 200 in w.cache
