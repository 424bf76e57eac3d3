"""Routing cost for choosing a decode worker (Dynamo's KV router).

cost(w) = overlap_weight · (prompt blocks w would have to prefill) + (KV blocks active on w)

The first term rewards prefix-cache hits, the second balances load; the cheapest eligible worker
wins, ties to the lowest index so the choice is deterministic. Inputs are arrays indexed by
worker position so a caller with a thousand workers pays one vectorised pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoutingWeights:
    overlap_weight: float = 1.0


@dataclass(frozen=True)
class RoutingInput:
    now_s: float
    num_prompt_blocks: int
    overlap_blocks: Mapping[int, int]   # worker index -> leading prompt blocks it holds (sparse)
    active_blocks: np.ndarray           # [num_workers] KV blocks in use (running + reserved)
    eligible: np.ndarray | None = None  # [num_workers] bool; False = draining or full


@dataclass(frozen=True)
class RoutingDecision:
    worker: int | None                  # None when no worker is eligible
    cost: float
    overlap_blocks: int


def route_costs(inp: RoutingInput, w: RoutingWeights = RoutingWeights()) -> np.ndarray:
    """[num_workers] cost of sending the request to each worker (inf where ineligible)."""
    costs = inp.active_blocks.astype(float) + w.overlap_weight * inp.num_prompt_blocks
    for worker, blocks in inp.overlap_blocks.items():
        costs[worker] -= w.overlap_weight * min(blocks, inp.num_prompt_blocks)
    if inp.eligible is not None:
        costs = np.where(inp.eligible, costs, np.inf)
    return costs


def choose_worker(inp: RoutingInput, w: RoutingWeights = RoutingWeights()) -> RoutingDecision:
    costs = route_costs(inp, w)
    if costs.size == 0:
        return RoutingDecision(None, float("inf"), 0)
    best = int(np.argmin(costs))
    if not np.isfinite(costs[best]):
        return RoutingDecision(None, float("inf"), 0)
    return RoutingDecision(best, float(costs[best]), int(inp.overlap_blocks.get(best, 0)))
