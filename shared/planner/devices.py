"""The cluster as a list of GPUs and as a weighted device graph (edge weight = link GB/s)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx

from shared.planner.config import ClusterSpec, GpuType
from shared.planner.costmodel import GroupHardware


@dataclass(frozen=True)
class Device:
    index: int          # position in Cluster.devices and node id in the device graph
    node: int           # index into ClusterSpec.nodes
    local: int          # GPU number within its node
    gpu_type: str

    def label(self, spec: ClusterSpec) -> str:
        return f"{spec.nodes[self.node].name}/gpu{self.local}"


class Cluster:
    """A ClusterSpec expanded into devices, with link bandwidths and group hardware lookups."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.devices: list[Device] = []
        for n, node in enumerate(spec.nodes):
            for local in range(node.num_gpus):
                self.devices.append(Device(len(self.devices), n, local, node.gpu_type))

    def __len__(self) -> int:
        return len(self.devices)

    def link_gbps(self, a: int, b: int) -> float:
        da, db = self.devices[a], self.devices[b]
        if da.node == db.node:
            return self.spec.nodes[da.node].intra_gbps
        return self.spec.inter_node_gbps

    def graph(self) -> nx.Graph:
        """GPUs as vertices; intra-node links as a clique, inter-node links rail-wise.

        Rail-optimised fabrics connect GPU *i* of every node through switch *i*, so inter-node
        edges join GPUs with the same local index; this keeps the graph sparse at 1,000 GPUs
        (the cut between nodes is what partitioning needs to see, not every path). A GPU's NIC is
        shared by all its remote peers, so each rail edge carries its share of the NIC bandwidth:
        summed over a GPU's rail edges the weight is the inter-node GB/s.
        """
        g = nx.Graph()
        for d in self.devices:
            g.add_node(d.index, node=d.node, gpu_type=d.gpu_type)
        by_node: dict[int, list[int]] = {}
        for d in self.devices:
            by_node.setdefault(d.node, []).append(d.index)
        for members in by_node.values():
            w = self.spec.nodes[self.devices[members[0]].node].intra_gbps
            g.add_edges_from(((a, b, {"weight": w}) for i, a in enumerate(members) for b in members[i + 1:]))
        rails: dict[int, list[int]] = {}
        for d in self.devices:
            rails.setdefault(d.local, []).append(d.index)
        w = self.spec.inter_node_gbps / max(len(self.spec.nodes) - 1, 1)
        for members in rails.values():
            g.add_edges_from(((a, b, {"weight": w}) for i, a in enumerate(members) for b in members[i + 1:]))
        return g

    def gpu_type(self, name: str) -> GpuType:
        return self.spec.gpu_types[name]

    def group_signature(self, group: Sequence[int]) -> tuple:
        """Hardware-equivalence key: groups with equal keys get equal cost-model results."""
        per_node: dict[int, int] = {}
        for i in group:
            per_node[self.devices[i].node] = per_node.get(self.devices[i].node, 0) + 1
        return tuple(sorted((self.devices[next(i for i in group if self.devices[i].node == n)].gpu_type,
                             self.spec.nodes[n].intra_gbps, c) for n, c in per_node.items()))

    def max_tp(self, group: Sequence[int]) -> int:
        """Largest TP degree whose subgroups (consecutive GPUs of one node) never cross a node."""
        counts: dict[int, int] = {}
        for i in group:
            counts[self.devices[i].node] = counts.get(self.devices[i].node, 0) + 1
        tp = 1
        while all(c % (tp * 2) == 0 for c in counts.values()) and len(group) % (tp * 2) == 0:
            tp *= 2
        return tp

    def hardware(self, group: Sequence[int]) -> GroupHardware:
        types = [self.gpu_type(self.devices[i].gpu_type) for i in group]
        slowest = GpuType(tflops_bf16=min(t.tflops_bf16 for t in types),
                          hbm_gib=min(t.hbm_gib for t in types),
                          hbm_gbps=min(t.hbm_gbps for t in types),
                          price_per_hour=min(t.price_per_hour for t in types))
        nodes = {self.devices[i].node for i in group}
        intra = min(self.spec.nodes[n].intra_gbps for n in nodes)
        pp_link = intra if len(nodes) == 1 else min(intra, self.spec.inter_node_gbps)
        shared = [self.spec.nodes[n].memory_gbps for n in nodes]
        node_memory = sum(shared) if all(g is not None for g in shared) else None
        return GroupHardware(gpu=slowest, tp_link_gbps=intra, pp_link_gbps=pp_link,
                             price_per_hour=sum(t.price_per_hour for t in types), node_hbm_gbps=node_memory)

    def route_gbps(self, a: Sequence[int], b: Sequence[int]) -> float:
        """Aggregate bandwidth for KV from group a to group b: slowest link times parallel lanes."""
        same_node = {self.devices[i].node for i in a} == {self.devices[i].node for i in b} and \
            len({self.devices[i].node for i in a}) == 1
        link = self.spec.nodes[self.devices[a[0]].node].intra_gbps if same_node else self.spec.inter_node_gbps
        return link * min(len(a), len(b))
