"""Ranks of a parallel group as threads of the test's process, each with a real process group."""

from __future__ import annotations

import threading

import torch

from shared.engine.parallel import free_port
from shared.model.parallel import ProcessGroupCollectives


def run_ranks(size: int, work, **group_kw) -> list:
    """``work(group)`` on each of ``size`` ranks, threads of this process, each ``group`` a
    ``ProcessGroupCollectives`` (``group_kw`` its options: ``shared_memory``, ``timeout_s``);
    their results in rank order. A rank's exception is raised here, in the test's thread."""
    port = free_port()
    group_kw = {"timeout_s": 60} | group_kw
    return on_threads(size, lambda rank: work(
        ProcessGroupCollectives(rank, size, "127.0.0.1", port, torch.device("cpu"), **group_kw)), join_s=120)


def on_threads(size: int, run_rank, join_s: float) -> list:
    """``run_rank(rank)`` for each of ``size`` ranks, each on a thread of this process, waiting up to
    ``join_s`` for each; their results in rank order. A rank's exception is raised here, in the
    test's thread."""
    results, errors = [None] * size, []

    def run(rank: int) -> None:
        try:
            results[rank] = run_rank(rank)
        except Exception as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    assert not errors, errors
    return results
