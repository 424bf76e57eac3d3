"""Group evaluation under the cost model, and the max-flow from requests to decode groups.

The flow network (rates in requests/s)::

    source --prefill capacity--> P_i --KV route capacity--> D_j --decode capacity--> sink

Its maximum is the plan's throughput. networkx's preflow-push computes it; the search calls
:meth:`Evaluator.flow_value`, which skips the solver when every route is provably non-binding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx
from networkx.algorithms.flow import preflow_push

from shared.planner.config import ModelSpec, WorkloadSpec
from shared.planner.costmodel import (GB, NO_CAPACITY, Efficiency, Parallel, PhaseCapacity,
                                      decode_capacity, kv_transfer_s, parallel_options,
                                      prefill_capacity)
from shared.planner.devices import Cluster

PREFILL, DECODE, IDLE = "prefill", "decode", "idle"


@dataclass(frozen=True)
class GroupEval:
    prefill_par: Parallel | None
    prefill: PhaseCapacity
    decode_par: Parallel | None
    decode: PhaseCapacity

    def rate(self, phase: str) -> float:
        return self.prefill.rate if phase == PREFILL else self.decode.rate if phase == DECODE else 0.0


@dataclass
class FlowResult:
    value: float
    routes: dict[tuple[int, int], float]   # (prefill group index, decode group index) -> req/s


class Evaluator:
    """Cost-model answers for groups of one cluster, model and workload (memoised by hardware)."""

    def __init__(self, cluster: Cluster, model: ModelSpec, workload: WorkloadSpec,
                 eff: Efficiency = Efficiency()):
        self.cluster, self.model, self.workload, self.eff = cluster, model, workload, eff
        self.input_len, self.output_len = workload.mean_lengths()
        self._cache: dict[tuple, GroupEval] = {}
        self._by_group: dict[tuple[int, ...], GroupEval] = {}
        # A request's KV leaves over the slowest fabric the cluster has (conservative for TTFT).
        self._worst_link = min([cluster.spec.inter_node_gbps] + [n.intra_gbps for n in cluster.spec.nodes]) \
            if len(cluster.spec.nodes) > 1 else cluster.spec.nodes[0].intra_gbps

    def evaluate(self, group: Sequence[int]) -> GroupEval:
        hit = self._by_group.get(tuple(group))
        if hit is None:
            key = self.cluster.group_signature(group)
            if key not in self._cache:
                self._cache[key] = self._evaluate(group)
            hit = self._by_group[tuple(group)] = self._cache[key]
        return hit

    def _evaluate(self, group: Sequence[int]) -> GroupEval:
        hw = self.cluster.hardware(group)
        transfer = kv_transfer_s(self.model, self.input_len, self._worst_link * len(group), self.eff)
        best_p, best_d = (None, NO_CAPACITY), (None, NO_CAPACITY)
        for par in parallel_options(len(group), self.cluster.max_tp(group)):
            p = prefill_capacity(self.model, hw, par, self.eff, self.input_len, self.workload.slo, transfer)
            d = decode_capacity(self.model, hw, par, self.eff, self.input_len, self.output_len,
                                self.workload.slo)
            if p.rate > best_p[1].rate:
                best_p = (par, p)
            if d.rate > best_d[1].rate:
                best_d = (par, d)
        return GroupEval(best_p[0], best_p[1], best_d[0], best_d[1])

    def route_rate(self, a: Sequence[int], b: Sequence[int]) -> float:
        """Requests/s whose KV the route from group a to group b can carry."""
        gbps = self.cluster.route_gbps(a, b)
        return gbps * GB * self.eff.link / (self.model.kv_bytes_per_token() * self.input_len)

    def max_flow(self, groups: Sequence[Sequence[int]], phases: Sequence[str]) -> FlowResult:
        """Exact max-flow with networkx preflow-push, with the per-route flow rates."""
        g = nx.DiGraph()
        src, sink = "source", "sink"
        pre = [i for i, ph in enumerate(phases) if ph == PREFILL]
        dec = [j for j, ph in enumerate(phases) if ph == DECODE]
        for i in pre:
            g.add_edge(src, ("p", i), capacity=self.evaluate(groups[i]).prefill.rate)
        for j in dec:
            g.add_edge(("d", j), sink, capacity=self.evaluate(groups[j]).decode.rate)
        for i in pre:
            for j in dec:
                g.add_edge(("p", i), ("d", j), capacity=self.route_rate(groups[i], groups[j]))
        if not pre or not dec:
            return FlowResult(0.0, {})
        residual = preflow_push(g, src, sink)
        routes = {(i, j): residual[("p", i)][("d", j)]["flow"] for i in pre for j in dec
                  if residual[("p", i)][("d", j)]["flow"] > 1e-12}
        return FlowResult(residual.graph["flow_value"], routes)

    def flow_value(self, groups: Sequence[Sequence[int]], phases: Sequence[str]) -> float:
        """Max-flow value. If every route carries at least min(its two end capacities), the min cut
        is min(sum prefill, sum decode) (any cut through routes costs at least that much), so the
        solver is skipped; otherwise preflow-push runs."""
        pcap = [(len(groups[i]), self.evaluate(groups[i]).prefill.rate)
                for i, ph in enumerate(phases) if ph == PREFILL]
        dcap = [(len(groups[j]), self.evaluate(groups[j]).decode.rate)
                for j, ph in enumerate(phases) if ph == DECODE]
        bound = min(sum(c for _, c in pcap), sum(c for _, c in dcap))
        # Slowest possible route between groups of sizes a and b: the worst link times min(a, b) lanes.
        per_lane = self._worst_link * GB * self.eff.link / (self.model.kv_bytes_per_token() * self.input_len)
        if all(per_lane * min(si, sj) >= min(ci, cj) for si, ci in pcap for sj, cj in dcap):
            return bound
        return self.max_flow(groups, phases).value
