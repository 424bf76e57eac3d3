"""KV-aware worker choice and queue-limit admission (pure: no I/O, no clock of its own).

Dynamo's KV router cost: a worker must prefill the blocks it does not already hold and then keeps
all of the request's blocks active, so

    cost = overlap_weight * (num_request_blocks - num_overlap_blocks)      # new prefill work
           + num_active_blocks + num_request_blocks                        # decode memory after
           + queue_weight * (num_waiting + num_admitted_unreported)        # requests ahead of it

Lowest cost wins; ties go to the fewer active blocks, then the worker id (deterministic). The
queue limit applies to the queue the worker reported: requests admitted since its last report
steer the choice but never cause a rejection on their own (they may well have finished).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoadView:
    worker_id: str
    num_active_blocks: int   # KV blocks in use, plus ones admitted but not yet reported
    num_waiting: int         # queued requests, as last reported by the worker
    num_admitted_unreported: int = 0  # admitted here since that report


@dataclass(frozen=True)
class RoutingWeights:
    overlap_weight: float = 1.0
    queue_weight: float = 4.0
    max_waiting_per_worker: int = 32


@dataclass(frozen=True)
class RoutingChoice:
    worker_id: str | None            # None: rejected, every worker's queue is at its limit
    num_overlap_blocks: int = 0
    cost: float = 0.0


def routing_cost(worker: WorkerLoadView, num_request_blocks: int, num_overlap_blocks: int,
                 weights: RoutingWeights) -> float:
    assert 0 <= num_overlap_blocks <= num_request_blocks, (num_overlap_blocks, num_request_blocks)
    prefill = num_request_blocks - num_overlap_blocks
    return (weights.overlap_weight * prefill + worker.num_active_blocks + num_request_blocks
            + weights.queue_weight * (worker.num_waiting + worker.num_admitted_unreported))


def choose_worker(workers: Sequence[WorkerLoadView], overlaps: Mapping[str, int],
                  num_request_blocks: int, weights: RoutingWeights = RoutingWeights()) -> RoutingChoice:
    """Pick the cheapest worker whose queue is under ``max_waiting_per_worker``.

    ``overlaps`` maps worker id → leading prompt blocks it holds (missing: 0; an empty mapping is
    the least-loaded fallback when the index does not answer)."""
    best: tuple[float, int, str] | None = None
    for w in workers:
        if w.num_waiting >= weights.max_waiting_per_worker:
            continue
        overlap = min(overlaps.get(w.worker_id, 0), num_request_blocks)
        key = (routing_cost(w, num_request_blocks, overlap, weights), w.num_active_blocks, w.worker_id)
        if best is None or key < best:
            best = key
    if best is None:
        return RoutingChoice(worker_id=None)
    return RoutingChoice(worker_id=best[2], num_overlap_blocks=min(overlaps.get(best[2], 0),
                                                                    num_request_blocks), cost=best[0])
