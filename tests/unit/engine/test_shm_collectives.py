"""Shared-memory collectives: all-reduce sums in rank order, the same bits on every rank, for 2 to 4
ranks, float32 and bfloat16, from one element to several slots; many calls of varied sizes in a row
(the two slot parities reused); all-gather order; broadcast; a rank that dies or closes, or is late,
breaks the waits of the others with a RuntimeError naming it, except that broadcast has no time
limit. Ranks are threads of this process meeting in one in-process store, except the rank that is
killed, a process."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from shared.engine.parallel import free_port
from shared.model.parallel import ProcessGroupCollectives
from shared.model.shm_collectives import SharedMemoryCollectives
from thread_ranks import on_threads

SMALL_SLOT = 4096  # bytes: 1024 float32 values, so a few thousand values already take several steps


def run_ranks(size: int, work, **kw) -> list:
    """``work(shm)`` on each of ``size`` ranks, threads of this process; their results in rank order."""
    # one in-process store for the threads (a TCPStore client at times takes 5 s to connect)
    store = dist.HashStore()

    def run(rank: int):
        shm = SharedMemoryCollectives(store, rank, size, **({"timeout_s": 30} | kw))
        result = work(shm)
        shm.close()
        return result

    return on_threads(size, run, join_s=60)


def rank_tensor(rank: int, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(numel, generator=gen).to(dtype)


def rank_order_sum(size: int, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """slot0 + slot1 + ..., in float32 (a 16-bit float rounded once, at the end)."""
    total = rank_tensor(0, numel, dtype, seed).float()
    for r in range(1, size):
        total = total + rank_tensor(r, numel, dtype, seed).float()
    return total.to(dtype)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 577, 2048, 2049, 5 * 1024 + 3])
def test_all_reduce_sums_in_rank_order_with_the_same_bits_on_every_rank(size, dtype, numel):
    def reduce(shm):
        t = rank_tensor(shm.rank, numel, dtype)
        out = shm.all_reduce(t)
        assert out is t and out.dtype == dtype
        return out

    results = run_ranks(size, reduce, slot_bytes=SMALL_SLOT)  # 2048 bf16 or 1024 float32 values a step
    expected = rank_order_sum(size, numel, dtype)
    for got in results:
        assert torch.equal(got, expected)


def test_a_tensor_of_a_whole_default_slot_and_a_non_contiguous_one():
    def reduce(shm):
        whole = torch.full((512, 2048), float(shm.rank + 1))  # 4 MiB: the default slot, one step
        strided = torch.arange(12.0).view(3, 4).t() * (shm.rank + 1)  # [4, 3], not contiguous
        return shm.all_reduce(whole), shm.all_reduce(strided), shm.seq

    for whole, strided, steps in run_ranks(2, reduce):
        assert torch.equal(whole, torch.full((512, 2048), 3.0))
        assert torch.equal(strided, torch.arange(12.0).view(3, 4).t() * 3)
        assert steps == 2


def test_many_calls_of_varied_sizes_in_a_row_reuse_both_slots_safely():
    sizes = [(7 * i) % 3000 + 1 for i in range(300)]  # 1 to 3000 values: one to three steps each

    def many(shm):
        # rank 0 dawdles now and then, so the others run ahead as far as the double buffer allows
        return [(time.sleep(0.001) if shm.rank == 0 and i % 37 == 0 else None,
                 shm.all_reduce(rank_tensor(shm.rank, n, torch.float32, seed=i)))[1]
                for i, n in enumerate(sizes)]

    results = run_ranks(3, many, slot_bytes=SMALL_SLOT)
    for i, n in enumerate(sizes):
        expected = rank_order_sum(3, n, torch.float32, seed=i)
        for rank in range(3):
            assert torch.equal(results[rank][i], expected), (i, n, rank)


def test_calls_in_and_out_of_inference_mode():
    def mixed(shm):
        with torch.inference_mode():  # the slots' views are made here first
            inside = shm.all_reduce(torch.ones(3000))
        outside = shm.all_reduce(torch.ones(3000))
        return inside, outside, shm.seq

    for inside, outside, steps in run_ranks(2, mixed, slot_bytes=SMALL_SLOT):
        assert torch.equal(inside, torch.full((3000,), 2.0)) and torch.equal(outside, inside)
        assert steps == 6  # 3000 values, 1024 a step: 3 steps a call


@pytest.mark.parametrize("slot_bytes", [SMALL_SLOT, 8 << 20])
def test_all_gather_puts_the_ranks_side_by_side_in_rank_order(slot_bytes):
    def gather(shm):
        t = torch.arange(2 * 3 * 700, dtype=torch.float32).view(2, 3, 700) + 10_000 * shm.rank
        return shm.all_gather(t)

    results = run_ranks(3, gather, slot_bytes=slot_bytes)  # 4200 values: 5 steps of the small slot
    base = torch.arange(2 * 3 * 700, dtype=torch.float32).view(2, 3, 700)
    expected = torch.cat([base + 10_000 * r for r in range(3)], dim=-1)
    for got in results:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("src", [0, 2])
def test_broadcast_copies_the_source_ranks_tensor_into_every_rank(src):
    def broadcast(shm):
        header = torch.tensor([7, 1, 2, 3]) if shm.rank == src else torch.zeros(4, dtype=torch.long)
        rows = torch.full((3, 1500), float(shm.rank))  # 4500 float32 values: 5 steps of the small slot
        return shm.broadcast(header, src), shm.broadcast(rows, src)

    for header, rows in run_ranks(3, broadcast, slot_bytes=SMALL_SLOT):
        assert header.tolist() == [7, 1, 2, 3]
        assert torch.equal(rows, torch.full((3, 1500), float(src)))


@pytest.mark.parametrize("shared_memory", [True, False])
def test_the_process_group_meets_in_shared_memory_on_one_host_unless_told_not_to(shared_memory):
    port, results = free_port(), [None] * 2

    def run(rank: int) -> None:
        group = ProcessGroupCollectives(rank, 2, "127.0.0.1", port, torch.device("cpu"), timeout_s=30,
                                        shared_memory=shared_memory)
        summed = group.all_reduce(torch.full((2, 576), rank + 1.0))
        results[rank] = (group.shm is not None, summed, group.all_gather(torch.full((2, 3), float(rank))))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for uses_shm, summed, gathered in results:
        assert uses_shm == shared_memory
        assert torch.equal(summed, torch.full((2, 576), 3.0))
        assert gathered.tolist() == [[0.0] * 3 + [1.0] * 3] * 2


def test_a_late_rank_times_all_reduce_out_but_not_broadcast():
    def late(shm):
        if shm.rank == 1:
            time.sleep(0.6)
            shm.broadcast(torch.zeros(3))
            time.sleep(0.6)
            shm.all_reduce(torch.zeros(3))  # too late for rank 0, which gave up (its values are there)
            return None
        got = shm.broadcast(torch.ones(3))  # waits 0.6 s, past timeout_s: no limit here
        with pytest.raises(RuntimeError, match=r"rank 0 timed out after 0 s at step 2: ranks \[1\]"):
            shm.all_reduce(torch.ones(3))
        return got

    rank0, _ = run_ranks(2, late, timeout_s=0.3, check_interval_s=0.05)
    assert torch.equal(rank0, torch.ones(3))


def test_a_rank_that_closes_breaks_the_others_waits():
    def leave(shm):
        if shm.rank == 1:
            shm.close()
            return None
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) closed its collectives while rank 0 waited"):
            shm.broadcast(torch.ones(3))
        return True

    assert run_ranks(2, leave, check_interval_s=0.05)[0]


PEER = """
import sys, time, torch, torch.distributed as dist
from shared.model.shm_collectives import SharedMemoryCollectives
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False)
shm = SharedMemoryCollectives(store, 1, 2)
shm.all_reduce(torch.ones(4))
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)  # a broken dead-peer check would wait in broadcast for ever: red in a minute, not 10
@pytest.mark.parametrize("op", ["all_reduce", "broadcast"])
def test_a_peer_process_killed_while_rank_0_waits_raises_within_seconds(op):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        shm = SharedMemoryCollectives(store, 0, 2, timeout_s=600, check_interval_s=0.05)
        assert torch.equal(shm.all_reduce(torch.ones(4)), torch.full((4,), 2.0))
        assert peer.stdout.readline().strip() == "ready"
        # killed, not reaped: a zombie, as a follower is until rank 0 (its parent) waits for it
        threading.Timer(0.3, peer.send_signal, (signal.SIGKILL,)).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {peer.pid}\) is gone: rank 0 waited"):
            getattr(shm, op)(torch.ones(4))
        assert time.monotonic() - start < 5
        shm.close()
    finally:
        peer.kill()
        peer.wait()
