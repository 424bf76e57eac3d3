"""Group evaluation under the cost model, and the max-flow from requests to decode groups.

The flow network (rates in requests/s)::

    source --prefill capacity--> P_i --KV route capacity--> D_j --decode capacity--> sink

where a route between nodes also passes each group's NICs (P_i -> PN_i and DN_j -> D_j, capacity
the group's inter-node bandwidth), which all of that group's inter-node routes share.

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
        self.tail_input_len = workload.tail_input_len()
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
        tail_transfer = kv_transfer_s(self.model, self.tail_input_len, self._worst_link * len(group), self.eff)
        best_p, best_d = (None, NO_CAPACITY), (None, NO_CAPACITY)
        for par in parallel_options(len(group), self.cluster.max_tp(group), self.model):
            p = prefill_capacity(self.model, hw, par, self.eff, self.input_len, self.workload.slo, transfer,
                                 self.tail_input_len, tail_transfer)
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

    def nic_rate(self, group: Sequence[int]) -> float:
        """Requests/s of KV a group's NICs carry in (or out) over the inter-node fabric."""
        gbps = self.cluster.spec.inter_node_gbps * len(group)
        return gbps * GB * self.eff.link / (self.model.kv_bytes_per_token() * self.input_len)

    def _same_node(self, a: Sequence[int], b: Sequence[int]) -> bool:
        nodes = {self.cluster.devices[d].node for d in a}
        return len(nodes) == 1 and nodes == {self.cluster.devices[d].node for d in b}

    def max_flow(self, groups: Sequence[Sequence[int]], phases: Sequence[str]) -> FlowResult:
        """Exact max-flow with networkx preflow-push, with the per-route flow rates.

        KV between groups on one node goes over the node's links; between nodes it leaves through
        the prefill group's NICs and enters through the decode group's, so each group's NIC
        bandwidth is shared by all its inter-node routes (node-split: p -> pn, dn -> d).
        """
        pre = [i for i, ph in enumerate(phases) if ph == PREFILL]
        dec = [j for j, ph in enumerate(phases) if ph == DECODE]
        if not pre or not dec:
            return FlowResult(0.0, {})
        g = nx.DiGraph()
        src, sink = "source", "sink"
        for i in pre:
            g.add_edge(src, ("p", i), capacity=self.evaluate(groups[i]).prefill.rate)
            g.add_edge(("p", i), ("pn", i), capacity=self.nic_rate(groups[i]))
        for j in dec:
            g.add_edge(("d", j), sink, capacity=self.evaluate(groups[j]).decode.rate)
            g.add_edge(("dn", j), ("d", j), capacity=self.nic_rate(groups[j]))
        for i in pre:
            for j in dec:
                near = self._same_node(groups[i], groups[j])
                g.add_edge(("p", i) if near else ("pn", i), ("d", j) if near else ("dn", j),
                           capacity=self.route_rate(groups[i], groups[j]))
        residual = preflow_push(g, src, sink)
        routes = {}
        for i in pre:
            for j in dec:
                u, v = (("p", i), ("d", j)) if self._same_node(groups[i], groups[j]) else (("pn", i), ("dn", j))
                if residual[u][v]["flow"] > 1e-12:
                    routes[(i, j)] = residual[u][v]["flow"]
        return FlowResult(residual.graph["flow_value"], routes)

    def flow_value(self, groups: Sequence[Sequence[int]], phases: Sequence[str]) -> float:
        """Max-flow value. If every route carries at least min(its two end capacities) and every
        group's NICs carry at least its own capacity, the min cut is min(sum prefill, sum decode)
        (any cut through routes or NICs costs at least that much), so the solver is skipped;
        otherwise preflow-push runs."""
        pcap = [(len(groups[i]), self.evaluate(groups[i]).prefill.rate)
                for i, ph in enumerate(phases) if ph == PREFILL]
        dcap = [(len(groups[j]), self.evaluate(groups[j]).decode.rate)
                for j, ph in enumerate(phases) if ph == DECODE]
        bound = min(sum(c for _, c in pcap), sum(c for _, c in dcap))
        # Slowest possible route between groups of sizes a and b: the worst link times min(a, b) lanes.
        per_lane = self._worst_link * GB * self.eff.link / (self.model.kv_bytes_per_token() * self.input_len)
        nic_lane = self.cluster.spec.inter_node_gbps * GB * self.eff.link / (
            self.model.kv_bytes_per_token() * self.input_len)
        nics_wide = len(self.cluster.spec.nodes) == 1 or all(nic_lane * s >= c for s, c in pcap + dcap)
        if nics_wide and all(per_lane * min(si, sj) >= min(ci, cj) for si, ci in pcap for sj, cj in dcap):
            return bound
        return self.max_flow(groups, phases).value
