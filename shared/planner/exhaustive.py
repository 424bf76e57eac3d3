"""Exhaustive search over every grouping and phase assignment of a small cluster (<= 8 GPUs).

The reference the planner is checked against: same cost model, same flow, every set partition of
the GPUs and every prefill/decode labelling of its groups (idle never raises a flow). Labellings are pruned by the
bound min(sum prefill, sum decode), which the flow cannot exceed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from shared.planner.flow import DECODE, IDLE, PREFILL, Evaluator
from shared.planner.search import State

MAX_GPUS = 8


def set_partitions(items: list[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first]] + part
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]


def exhaustive(ev: Evaluator) -> State:
    n = len(ev.cluster)
    if n > MAX_GPUS:
        raise ValueError(f"exhaustive search is for <= {MAX_GPUS} GPUs, cluster has {n}")
    best = State([list(range(n))], [IDLE], 0.0)
    for part in set_partitions(list(range(n))):
        groups = [sorted(g) for g in part]
        evals = [ev.evaluate(g) for g in groups]
        for labels in itertools.product((PREFILL, DECODE), repeat=len(groups)):
            p = sum(e.prefill.rate for e, ph in zip(evals, labels) if ph == PREFILL)
            d = sum(e.decode.rate for e, ph in zip(evals, labels) if ph == DECODE)
            if min(p, d) <= best.value:
                continue
            value = ev.flow_value(groups, list(labels))
            if value > best.value:
                best = State(groups, list(labels), value)
    return best
