"""KV-aware choice of a decode worker (pure: no I/O, no clock of its own).

Dynamo's KV router cost: a worker must prefill the blocks it does not already hold and then keeps
all of the request's blocks active, so

    cost = overlap_weight * (num_request_blocks - num_overlap_blocks)      # new prefill work
           + num_active_blocks + num_request_blocks                        # decode memory after
           + queue_weight * (num_waiting + num_admitted_unreported)        # requests ahead of it

Lowest cost wins; ties go to the fewer active blocks, then to the first worker in turn after the
one chosen last (``tie_start``: the index to count from). Ties are the common case for a new
conversation on a quiet cluster: every worker holds only the shared system prompt and none is
busy. Breaking them by the lower index sent 99 of 150 requests of a Mooncake replay to the first of
two workers, whose queue then cost more TTFT than kv routing's cache hits saved. A worker whose
reported queue is at ``max_waiting_per_worker`` is not chosen. ``route_in_turn`` is the baseline
this is judged against: the usable workers in turn, whatever they hold. Requests admitted since a worker's
last report steer the choice but never exclude a worker on their own (they may well have finished).

One implementation, over arrays: the simulator routes a million requests over hundreds of workers
with it, and the admission service calls it through ``choose_worker`` with one view per worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoutingWeights:
    overlap_weight: float = 1.0
    queue_weight: float = 4.0
    max_waiting_per_worker: int = 32
    # a block held below a worker's pool saves part of its prefill: it is copied back first
    # (host memory: a memcpy; disk: a file read), so it counts between a pool hit (1) and a miss (0)
    host_block_credit: float = 0.9
    disk_block_credit: float = 0.6


def effective_overlap(num_blocks: int, num_host_blocks: int, num_disk_blocks: int,
                      w: RoutingWeights = RoutingWeights()) -> float:
    """Leading blocks a worker holds, each counted by the tier it must come from."""
    return (num_blocks - (1 - w.host_block_credit) * num_host_blocks
            - (1 - w.disk_block_credit) * num_disk_blocks)


@dataclass(frozen=True)
class RoutingInput:
    now_s: float
    num_request_blocks: int
    overlap_blocks: Mapping[int, float]  # worker index -> leading prompt blocks it holds (sparse;
                                         # see effective_overlap for blocks below the pool)
    active_blocks: np.ndarray           # [num_workers] KV blocks in use (running + reserved)
    num_waiting: np.ndarray             # [num_workers] requests queued at the worker (as reported)
    eligible: np.ndarray | None = None  # [num_workers] bool; False = not a decode worker / draining
    num_unreported: np.ndarray | None = None  # [num_workers] admitted since the worker's last report


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
    queued = inp.num_waiting if inp.num_unreported is None else inp.num_waiting + inp.num_unreported
    costs = w.overlap_weight * prefill + inp.active_blocks + n + w.queue_weight * queued
    usable = inp.num_waiting < w.max_waiting_per_worker
    if inp.eligible is not None:
        usable &= inp.eligible
    return np.where(usable, costs, np.inf)


def _decision(inp: RoutingInput, costs: np.ndarray, worker: int) -> RoutingDecision:
    """Worker ``worker`` at its cost, with the leading blocks of the request it holds."""
    return RoutingDecision(int(worker), float(costs[worker]),
                           min(round(inp.overlap_blocks.get(int(worker), 0)), inp.num_request_blocks))


def route(inp: RoutingInput, w: RoutingWeights = RoutingWeights(), tie_start: int = 0) -> RoutingDecision:
    costs = route_costs(inp, w)
    if costs.size == 0 or not np.isfinite(costs.min()):
        return RoutingDecision(None, float("inf"), 0)
    tied = np.flatnonzero(costs == costs.min())
    if len(tied) > 1:
        tied = tied[inp.active_blocks[tied] == inp.active_blocks[tied].min()]
    return _decision(inp, costs, tied[np.argmin((tied - tie_start) % costs.size)])


def route_in_turn(inp: RoutingInput, start: int, w: RoutingWeights = RoutingWeights()) -> RoutingDecision:
    """Round robin: the first usable worker (eligible, under its queue limit) from index ``start``
    on, wrapping; its cost is what ``route`` would have charged it."""
    costs = route_costs(inp, w)
    n = costs.size
    for k in range(n):
        j = (start + k) % n
        if np.isfinite(costs[j]):
            return _decision(inp, costs, j)
    return RoutingDecision(None, float("inf"), 0)


# --- the same rule over per-worker views (the admission service's form) ---------------------------


@dataclass(frozen=True)
class WorkerLoadView:
    worker_id: str
    num_active_blocks: int   # KV blocks in use, plus ones admitted but not yet reported
    num_waiting: int         # queued requests, as last reported by the worker
    num_admitted_unreported: int = 0  # admitted here since that report


@dataclass(frozen=True)
class RoutingChoice:
    worker_id: str | None            # None: rejected, every worker's queue is at its limit
    num_overlap_blocks: int = 0
    cost: float = 0.0


def _over_views(workers: Sequence[WorkerLoadView], overlaps: Mapping[str, float], num_request_blocks: int,
                now_s: float) -> tuple[list[WorkerLoadView], dict[str, int], RoutingInput]:
    """The views by worker id, their indices, and the array input ``route`` takes."""
    views = sorted(workers, key=lambda v: v.worker_id)
    index = {v.worker_id: i for i, v in enumerate(views)}
    return views, index, RoutingInput(
        now_s, num_request_blocks, {index[w]: n for w, n in overlaps.items() if w in index},
        np.array([v.num_active_blocks for v in views], dtype=float),
        np.array([v.num_waiting for v in views], dtype=float),
        num_unreported=np.array([v.num_admitted_unreported for v in views], dtype=float))


def choose_worker(workers: Sequence[WorkerLoadView], overlaps: Mapping[str, float],
                  num_request_blocks: int, weights: RoutingWeights = RoutingWeights(),
                  now_s: float = 0.0, chosen_last: str = "", in_turn: bool = False) -> RoutingChoice:
    """``route`` over views: ``overlaps`` maps worker id → leading prompt blocks it holds (missing:
    0; an empty mapping is the least-loaded fallback when the index does not answer). Ties between
    equal costs and active blocks go to the first worker id after ``chosen_last`` (the worker id
    chosen last, wrapping; "": none yet). With ``in_turn``, ``route_in_turn`` instead: the next
    usable worker id after ``chosen_last``, whatever the costs."""
    views, _, inp = _over_views(workers, overlaps, num_request_blocks, now_s)
    after_last = sum(v.worker_id <= chosen_last for v in views)  # the index after it ("": 0)
    decision = route_in_turn(inp, after_last, weights) if in_turn else route(inp, weights, after_last)
    if decision.worker is None:
        return RoutingChoice(worker_id=None)
    return RoutingChoice(views[decision.worker].worker_id, decision.overlap_blocks, decision.cost)


def next_cheapest(inp: RoutingInput, chosen: int, w: RoutingWeights = RoutingWeights(),
                  limit: int = 3) -> list[RoutingDecision]:
    """The usable workers other than ``chosen``, cheapest first (ties: fewer active blocks, then
    index), at most ``limit``: where admission tries a request the routing's choice would serve too
    late (``Admitter.decide_first``)."""
    costs = route_costs(inp, w)
    others = [j for j in np.flatnonzero(np.isfinite(costs)) if j != chosen]
    others.sort(key=lambda j: (costs[j], inp.active_blocks[j], j))
    return [_decision(inp, costs, j) for j in others[:limit]]


def next_cheapest_workers(workers: Sequence[WorkerLoadView], overlaps: Mapping[str, float],
                          num_request_blocks: int, chosen: str, weights: RoutingWeights = RoutingWeights(),
                          now_s: float = 0.0, limit: int = 3) -> list[RoutingChoice]:
    """``next_cheapest`` over views: up to ``limit`` usable workers other than ``chosen`` (the
    worker id ``choose_worker`` gave), cheapest first."""
    views, index, inp = _over_views(workers, overlaps, num_request_blocks, now_s)
    return [RoutingChoice(views[d.worker].worker_id, d.overlap_blocks, d.cost)
            for d in next_cheapest(inp, index[chosen], weights, limit)]
