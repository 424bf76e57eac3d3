"""The planner's search, as HexGen-2 frames it: partition, assign phases, max-flow, refine.

1. Partition the device graph into groups of each candidate size (spectral + Kernighan-Lin).
2. Give each group its best parallel strategy per phase (cost model) and split the groups into
   prefill and decode where the max-flow bound min(sum prefill, sum decode) is largest.
3. Refine: flip a group's phase, exchange two groups' phases, split a group in two, merge two
   groups, swap devices of different types between groups, or move one device to another group,
   keeping the best move while the max-flow improves.

Every candidate move is ranked by the upper bound min(sum prefill, sum decode), which no flow can
exceed; the solver only runs on candidates whose bound beats the current plan, best first.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from shared.planner.flow import DECODE, IDLE, PREFILL, Evaluator
from shared.planner.partition import Partitioner

Groups = list[list[int]]


@dataclass
class State:
    groups: Groups
    phases: list[str]
    value: float = 0.0
    history: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Move:
    """Replace the groups at ``remove`` by ``add`` (group, phase) pairs; with ``rephase`` the
    phases of all groups are then chosen afresh by :func:`assign_phases`."""

    name: str
    remove: tuple[int, ...]
    add: tuple[tuple[tuple[int, ...], str], ...]
    rephase: bool = False

    def apply(self, ev: Evaluator, s: State) -> tuple[Groups, list[str]]:
        keep = [k for k in range(len(s.groups)) if k not in self.remove]
        groups = [s.groups[k] for k in keep] + [list(g) for g, _ in self.add]
        if self.rephase:
            return groups, assign_phases(ev, groups)
        return groups, [s.phases[k] for k in keep] + [ph for _, ph in self.add]


def _sums(ev: Evaluator, groups: Groups, phases: list[str]) -> tuple[float, float]:
    p = sum(ev.evaluate(g).prefill.rate for g, ph in zip(groups, phases) if ph == PREFILL)
    d = sum(ev.evaluate(g).decode.rate for g, ph in zip(groups, phases) if ph == DECODE)
    return p, d


def _move_bound(ev: Evaluator, s: State, sums: tuple[float, float], m: Move) -> float:
    """min(sum prefill, sum decode) after the move, from the changed groups only."""
    if m.rephase:
        return min(_sums(ev, *m.apply(ev, s)))
    p, d = sums
    for k in m.remove:
        p -= ev.evaluate(s.groups[k]).rate(PREFILL) if s.phases[k] == PREFILL else 0.0
        d -= ev.evaluate(s.groups[k]).rate(DECODE) if s.phases[k] == DECODE else 0.0
    for g, ph in m.add:
        p += ev.evaluate(g).rate(PREFILL) if ph == PREFILL else 0.0
        d += ev.evaluate(g).rate(DECODE) if ph == DECODE else 0.0
    return min(p, d)


EXACT_PHASES_MAX_GROUPS = 12


def assign_phases(ev: Evaluator, groups: Groups) -> list[str]:
    """Phases maximising min(sum prefill, sum decode): exactly for a few groups (all labellings),
    otherwise by ordering groups on how much better they prefill than decode and cutting where
    the bound is largest (the optimum of the fractional problem, so close for many groups)."""
    evals = [ev.evaluate(g) for g in groups]
    if len(groups) <= EXACT_PHASES_MAX_GROUPS:
        return _assign_exact(evals)
    order = sorted(range(len(groups)), key=lambda i: (
        -evals[i].prefill.rate / max(evals[i].prefill.rate + evals[i].decode.rate, 1e-12), i))
    total_d = sum(e.decode.rate for e in evals)
    best_k, best, run_p, run_d = 0, -1.0, 0.0, total_d
    for k in range(len(order) + 1):
        if min(run_p, run_d) > best:
            best_k, best = k, min(run_p, run_d)
        if k < len(order):
            run_p += evals[order[k]].prefill.rate
            run_d -= evals[order[k]].decode.rate
    phases = [DECODE] * len(groups)
    for i in order[:best_k]:
        phases[i] = PREFILL
    for i, e in enumerate(evals):
        if e.prefill.rate == 0 and e.decode.rate == 0:
            phases[i] = IDLE
    return phases


def _assign_exact(evals: list) -> list[str]:
    n = len(evals)
    labels = (np.arange(2**n)[:, None] >> np.arange(n)[None, :]) & 1   # [2^n, n], 1 = prefill
    p = labels @ np.array([e.prefill.rate for e in evals])
    d = (1 - labels) @ np.array([e.decode.rate for e in evals])
    best = labels[int(np.argmax(np.minimum(p, d)))]
    return [IDLE if e.prefill.rate == 0 and e.decode.rate == 0 else PREFILL if b else DECODE
            for e, b in zip(evals, best)]


def _best_phase(ev: Evaluator, group: list[int], want: str) -> str:
    e = ev.evaluate(group)
    return want if e.rate(want) > 0 else (PREFILL if e.prefill.rate > 0 else DECODE if e.decode.rate > 0 else IDLE)


class _Splitter:
    """Bisections of groups, memoised (the same group is offered for splitting every round)."""

    def __init__(self, parts: Partitioner):
        self._parts = parts
        self._cache: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def __call__(self, group: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        key = tuple(group)
        if key not in self._cache:
            a, b = self._parts.bisect(group, len(group) // 2)
            self._cache[key] = (tuple(a), tuple(b))
        return self._cache[key]


REPHASE_MAX_GROUPS = 32


def _moves(ev: Evaluator, s: State, split: _Splitter, rng: random.Random, max_swaps: int) -> Iterator[Move]:
    n = len(s.groups)
    rephase = n <= REPHASE_MAX_GROUPS  # re-labelling everything per candidate is O(n log n)
    for i, g in enumerate(s.groups):
        for ph in (PREFILL, DECODE, IDLE):
            if ph != s.phases[i]:
                yield Move(f"phase g{i}->{ph}", (i,), ((tuple(g), ph),))
    pre = [i for i in range(n) if s.phases[i] == PREFILL]
    dec = [j for j in range(n) if s.phases[j] == DECODE]
    for i in pre:
        for j in dec:
            yield Move(f"exchange phases g{i}<->g{j}", (i, j),
                       ((tuple(s.groups[i]), DECODE), (tuple(s.groups[j]), PREFILL)))
    for i, g in enumerate(s.groups):
        if len(g) > 1:
            a, b = split(g)
            for pa in (PREFILL, DECODE):
                for pb in (PREFILL, DECODE):
                    yield Move(f"split g{i}", (i,), ((a, pa), (b, pb)))
            if rephase:
                yield Move(f"split g{i}, rephase", (i,), ((a, IDLE), (b, IDLE)), rephase=True)
    # Merge equal-sized groups of the same nodes; in small plans, any two equal-sized groups.
    by_node: dict[tuple, list[int]] = {}
    for i, g in enumerate(s.groups):
        where = () if n <= 32 else tuple(sorted({ev.cluster.devices[d].node for d in g}))
        by_node.setdefault((where, len(g)), []).append(i)
    for members in by_node.values():
        for x, i in enumerate(members):
            for j in members[x + 1:]:
                merged = tuple(sorted(s.groups[i] + s.groups[j]))
                for ph in (PREFILL, DECODE):
                    yield Move(f"merge g{i}+g{j}", (i, j), ((merged, ph),))
                if rephase:
                    yield Move(f"merge g{i}+g{j}, rephase", (i, j), ((merged, IDLE),), rephase=True)
    yield from _swaps(ev, s, rng, max_swaps, rephase)
    yield from _transfers(ev, s, rng, max_swaps, rephase)


def _swaps(ev: Evaluator, s: State, rng: random.Random, max_swaps: int, rephase: bool) -> Iterator[Move]:
    """Swap one device between two groups whose GPU types differ (sampled when there are many)."""
    types = [{ev.cluster.devices[d].gpu_type for d in g} for g in s.groups]
    pairs = [(i, j) for i in range(len(s.groups)) for j in range(i + 1, len(s.groups)) if types[i] != types[j]]
    if len(pairs) > max_swaps:
        pairs = rng.sample(pairs, max_swaps)
    for i, j in pairs:
        gi, gj = s.groups[i], s.groups[j]
        di = next((d for d in gi if ev.cluster.devices[d].gpu_type not in types[j]), gi[0])
        dj = next((d for d in gj if ev.cluster.devices[d].gpu_type not in types[i]), gj[0])
        if ev.cluster.devices[di].gpu_type == ev.cluster.devices[dj].gpu_type:
            continue
        new_i = tuple(sorted([d for d in gi if d != di] + [dj]))
        new_j = tuple(sorted([d for d in gj if d != dj] + [di]))
        yield Move(f"swap g{i}:{di}<->g{j}:{dj}", (i, j),
                   ((new_i, _best_phase(ev, list(new_i), s.phases[i])),
                    (new_j, _best_phase(ev, list(new_j), s.phases[j]))))
        if rephase:
            yield Move(f"swap g{i}:{di}<->g{j}:{dj}, rephase", (i, j), ((new_i, IDLE), (new_j, IDLE)),
                       rephase=True)


def _transfers(ev: Evaluator, s: State, rng: random.Random, max_moves: int, rephase: bool) -> Iterator[Move]:
    """Move one device (one of each GPU type present) from one group to another: group sizes
    change, e.g. 4+4 becomes 3+5."""
    n = len(s.groups)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j and len(s.groups[i]) > 1]
    if len(pairs) > max_moves:
        pairs = rng.sample(pairs, max_moves)
    for i, j in pairs:
        one_per_type = {ev.cluster.devices[d].gpu_type: d for d in s.groups[i]}
        for d in sorted(one_per_type.values()):
            yield from _transfer(s, i, j, d, rephase)


def _transfer(s: State, i: int, j: int, d: int, rephase: bool) -> Iterator[Move]:
    new_i = tuple(x for x in s.groups[i] if x != d)
    new_j = tuple(sorted(s.groups[j] + [d]))
    yield Move(f"move {d} g{i}->g{j}", (i, j), ((new_i, s.phases[i]), (new_j, s.phases[j])))
    if rephase:
        yield Move(f"move {d} g{i}->g{j}, rephase", (i, j), ((new_i, IDLE), (new_j, IDLE)), rephase=True)


def refine(ev: Evaluator, s: State, parts: Partitioner, max_rounds: int = 50, max_swaps: int = 64,
           seed: int = 0) -> State:
    """Apply the best improving move (by true max-flow) until none improves or rounds run out."""
    rng = random.Random(seed)
    split = _Splitter(parts)
    for _ in range(max_rounds):
        sums = _sums(ev, s.groups, s.phases)
        candidates = [(_move_bound(ev, s, sums, m), m) for m in _moves(ev, s, split, rng, max_swaps)]
        candidates = [c for c in candidates if c[0] > s.value * (1 + 1e-9)]
        candidates.sort(key=lambda c: -c[0])
        best = None
        for bound, move in candidates:
            if best and bound <= best[0]:
                break  # no later candidate can beat the best flow found this round
            groups, phases = move.apply(ev, s)
            value = ev.flow_value(groups, phases)
            if value > s.value * (1 + 1e-9) and (best is None or value > best[0]):
                best = (value, move.name, groups, phases)
        if best is None:
            break
        s = State(best[2], best[3], best[0], s.history + [best[1]])
    return s


def candidate_sizes(ev: Evaluator) -> list[int]:
    """Group sizes worth partitioning for: powers of two up to twice the largest node (big models
    on small nodes need groups that span nodes)."""
    biggest = max(n.num_gpus for n in ev.cluster.spec.nodes)
    sizes, size = [], 1
    while size <= max(2 * biggest, 8) and size <= len(ev.cluster):
        sizes.append(size)
        size *= 2
    return sizes


def _size_can_serve(ev: Evaluator, size: int) -> bool:
    """Whether some node-aligned group of ``size`` GPUs (or a whole node, if smaller) can serve a
    phase; saves partitioning for sizes at which the model does not fit anywhere."""
    for node in range(len(ev.cluster.spec.nodes)):
        members = [d.index for d in ev.cluster.devices if d.node == node]
        if len(members) >= size or size > max(n.num_gpus for n in ev.cluster.spec.nodes):
            e = ev.evaluate(members[:size])
            if e.prefill.rate > 0 or e.decode.rate > 0 or len(members) < size:
                return True
    return False


def search(ev: Evaluator, sizes: list[int] | None = None, max_rounds: int = 50,
           max_swaps: int = 64, seed: int = 0) -> State:
    parts = Partitioner(ev.cluster.graph(), seed=seed)
    best: State | None = None
    for size in sizes or candidate_sizes(ev):
        if not _size_can_serve(ev, size):
            continue
        groups = parts.partition(list(range(len(ev.cluster))), size)
        if all(ev.evaluate(g).prefill.rate == 0 and ev.evaluate(g).decode.rate == 0 for g in groups):
            continue
        phases = assign_phases(ev, groups)
        state = refine(ev, State(groups, phases, ev.flow_value(groups, phases), [f"partition size {size}"]),
                       parts, max_rounds, max_swaps, seed)
        if best is None or state.value > best.value:
            best = state
    return best or State([list(range(len(ev.cluster)))], [IDLE], 0.0, ["nothing fits"])
