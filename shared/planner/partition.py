"""Split the device graph into groups: spectral bisection refined by Kernighan-Lin, recursively.

Each cut is placed where the Fiedler vector orders the vertices (so weak links, i.e. node and
rail boundaries, are cut first) and then improved by networkx's Kernighan-Lin, which swaps pairs
and so keeps the sizes the spectral step chose.
"""

from __future__ import annotations

import importlib.util

import networkx as nx
import numpy as np
from networkx.algorithms.community import kernighan_lin_bisection

_HAS_SCIPY = importlib.util.find_spec("scipy") is not None


def fiedler_order(g: nx.Graph) -> list:
    """Vertices sorted by their Fiedler-vector entry (ties by vertex id, so the order is stable).

    networkx's ``fiedler_vector`` needs scipy, which Tandem does not depend on; without it the
    same vector comes from a dense eigendecomposition of the Laplacian (fine up to a few
    thousand vertices).
    """
    nodes = sorted(g.nodes)
    if len(nodes) <= 2:
        return nodes
    weights = {w for _, _, w in g.edges(data="weight", default=1.0)}
    if g.number_of_edges() == len(nodes) * (len(nodes) - 1) // 2 and len(weights) == 1:
        return nodes  # a uniform clique (one node's GPUs): every balanced cut is equally good
    if not nx.is_connected(g):
        # Unlinked parts are the natural cut: order component by component, each internally.
        parts = sorted(nx.connected_components(g), key=lambda c: (-len(c), min(c)))
        return [v for c in parts for v in fiedler_order(g.subgraph(c))]
    if _HAS_SCIPY:
        vec = nx.fiedler_vector(g, weight="weight", normalized=False, seed=0, method="lanczos")
        values = dict(zip(g.nodes, vec))
    else:
        adj = nx.to_numpy_array(g, nodelist=nodes, weight="weight")
        lap = np.diag(adj.sum(axis=1)) - adj
        _, vecs = np.linalg.eigh(lap)
        v = vecs[:, 1]
        # Fix the sign so the result does not depend on the eigensolver's choice.
        if v[np.argmax(np.abs(v) > 1e-9)] < 0:
            v = -v
        values = dict(zip(nodes, np.round(v, 9)))
    return sorted(nodes, key=lambda n: (values[n], n))


class Partitioner:
    """Bisects and partitions subsets of one device graph, memoising Fiedler orders: the planner
    partitions for several group sizes and bisects groups every refinement round, and the same
    vertex sets recur (the top-level cut is the same for every size)."""

    def __init__(self, g: nx.Graph, kl_iters: int = 2, seed: int = 0):
        self.g, self.kl_iters, self.seed = g, kl_iters, seed
        self._orders: dict[frozenset, list] = {}

    def bisect(self, nodes: list, left_size: int) -> tuple[list, list]:
        """Cut ``nodes`` into parts of ``left_size`` and the rest, minimising the cut weight."""
        key = frozenset(nodes)
        sub = self.g.subgraph(nodes)
        if key not in self._orders:
            self._orders[key] = fiedler_order(sub)
        order = self._orders[key]
        left, right = set(order[:left_size]), set(order[left_size:])
        if left and right and self.kl_iters > 0 and sub.number_of_edges() > 0:
            left, right = kernighan_lin_bisection(sub, partition=(left, right), max_iter=self.kl_iters,
                                                  weight="weight", seed=self.seed)
        return sorted(left), sorted(right)

    def partition(self, nodes: list, group_size: int) -> list[list]:
        """Recursive bisection into groups of ``group_size`` vertices (the last may be smaller)."""
        nodes = sorted(nodes)
        if len(nodes) <= group_size:
            return [nodes]
        num_groups = -(-len(nodes) // group_size)
        left, right = self.bisect(nodes, (num_groups // 2) * group_size)
        return self.partition(left, group_size) + self.partition(right, group_size)


def partition(g: nx.Graph, group_size: int, kl_iters: int = 2, seed: int = 0) -> list[list]:
    return Partitioner(g, kl_iters, seed).partition(list(g.nodes), group_size)


def cut_weight(g: nx.Graph, groups: list[list]) -> float:
    where = {v: i for i, grp in enumerate(groups) for v in grp}
    return sum(d.get("weight", 1.0) for a, b, d in g.edges(data=True) if where[a] != where[b])
