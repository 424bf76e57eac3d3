"""Vectorised form of the decode-worker routing policy in :mod:`shared.policy.kv_routing`.

The admission service calls ``kv_routing.choose_worker`` with one view object per worker; the
simulator routes a million requests over hundreds of workers, so it calls this array form of the
same rule instead: the same cost (overlap_weight · blocks to prefill + active blocks + request
blocks + queue_weight · waiting), the same queue limit, the same ties (fewer active blocks, then
lower worker index — the index order must match the id order). A test checks that the two agree.
The simulator knows every worker's state exactly, so there are no admitted-but-unreported requests
(``WorkerLoadView.num_admitted_unreported`` is 0) and ``num_waiting`` is the true queue.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from shared.policy.kv_routing import RoutingWeights


@dataclass(frozen=True)
class RoutingInput:
    now_s: float
    num_request_blocks: int
    overlap_blocks: Mapping[int, int]   # worker index -> leading prompt blocks it holds (sparse)
    active_blocks: np.ndarray           # [num_workers] KV blocks in use (running + reserved)
    num_waiting: np.ndarray             # [num_workers] requests queued at the worker
    eligible: np.ndarray | None = None  # [num_workers] bool; False = not a decode worker / draining


@dataclass(frozen=True)
class RoutingDecision:
    worker: int | None                  # None: no eligible worker under its queue limit
    cost: float
    overlap_blocks: int


def route_costs(inp: RoutingInput, w: RoutingWeights = RoutingWeights()) -> np.ndarray:
    """[num_workers] cost of each worker (inf where ineligible or at the queue limit)."""
    n = inp.num_request_blocks
    prefill = np.full(len(inp.active_blocks), float(n))
    for worker, blocks in inp.overlap_blocks.items():
        prefill[worker] = n - min(blocks, n)
    # Same operation order as kv_routing.routing_cost, so equal inputs give bit-equal costs.
    costs = w.overlap_weight * prefill + inp.active_blocks + n + w.queue_weight * inp.num_waiting
    usable = inp.num_waiting < w.max_waiting_per_worker
    if inp.eligible is not None:
        usable &= inp.eligible
    return np.where(usable, costs, np.inf)


def choose_worker(inp: RoutingInput, w: RoutingWeights = RoutingWeights()) -> RoutingDecision:
    costs = route_costs(inp, w)
    if costs.size == 0 or not np.isfinite(costs.min()):
        return RoutingDecision(None, float("inf"), 0)
    tied = np.flatnonzero(costs == costs.min())
    best = int(tied[np.argmin(inp.active_blocks[tied])]) if len(tied) > 1 else int(tied[0])
    return RoutingDecision(best, float(costs[best]),
                           min(int(inp.overlap_blocks.get(best, 0)), inp.num_request_blocks))
