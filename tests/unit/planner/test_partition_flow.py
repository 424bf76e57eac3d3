import random

import networkx as nx
import pytest

from shared.planner.config import MODEL_PRESETS, preset_workload
from shared.planner.devices import Cluster
from shared.planner.flow import DECODE, PREFILL, Evaluator
from shared.planner.partition import cut_weight, fiedler_order, partition

from planner_helpers import make_cluster


def test_partition_cuts_between_nodes_not_inside():
    c = Cluster(make_cluster(("a100", 4), ("l40", 4), ("h100", 8)))
    groups = partition(c.graph(), 4)
    assert sorted(len(g) for g in groups) == [4, 4, 4, 4]
    for g in groups:
        assert len({c.devices[d].node for d in g}) == 1, g
    assert sorted(d for g in groups for d in g) == list(range(len(c)))


def test_partition_is_deterministic_and_beats_a_random_split():
    c = Cluster(make_cluster(*[("a100", 8)] * 4, inter_gbps=25))
    g = c.graph()
    assert partition(g, 8) == partition(g, 8)
    rng = random.Random(0)
    nodes = list(range(32))
    rng.shuffle(nodes)
    random_groups = [nodes[i:i + 8] for i in range(0, 32, 8)]
    assert cut_weight(g, partition(g, 8)) < cut_weight(g, random_groups)


def test_fiedler_order_handles_disconnected_graphs():
    g = nx.Graph()
    g.add_edges_from([(0, 1), (2, 3), (3, 4)], weight=1.0)
    order = fiedler_order(g)
    assert sorted(order) == [0, 1, 2, 3, 4]
    assert set(order[:3]) == {2, 3, 4}   # components stay contiguous, largest first


def _ev(*nodes, inter=12.5, model="llama-2-7b", workload="mixed"):
    return Evaluator(Cluster(make_cluster(*nodes, inter_gbps=inter)), MODEL_PRESETS[model],
                     preset_workload(workload))


def test_flow_is_min_of_pools_when_routes_are_wide():
    ev = _ev(("a100", 2), ("a100", 2))
    groups, phases = [[0], [1], [2], [3]], [PREFILL, DECODE, DECODE, DECODE]
    p = ev.evaluate([0]).prefill.rate
    d = ev.evaluate([1]).decode.rate
    assert ev.max_flow(groups, phases).value == pytest.approx(min(p, 3 * d))
    assert ev.flow_value(groups, phases) == pytest.approx(ev.max_flow(groups, phases).value)


def test_flow_is_limited_by_a_narrow_kv_link():
    ev = _ev(("h100", 1), ("h100", 1), inter=1.0)   # 1 GB/s between the two nodes
    groups, phases = [[0], [1]], [PREFILL, DECODE]
    result = ev.max_flow(groups, phases)
    assert result.value == pytest.approx(ev.route_rate([0], [1]))
    assert result.value < min(ev.evaluate([0]).prefill.rate, ev.evaluate([1]).decode.rate)
    assert result.routes == {(0, 1): pytest.approx(result.value)}
    assert ev.flow_value(groups, phases) == pytest.approx(result.value)


@pytest.mark.parametrize("inter", [0.02, 0.2, 12.5])
def test_flow_value_shortcut_matches_preflow_push(inter):
    ev = _ev(("a100", 2), ("l40", 2), ("a6000", 2), inter=inter)
    rng = random.Random(int(inter * 100))
    for _ in range(20):
        groups = [[0], [1], [2, 3], [4], [5]]
        phases = [rng.choice([PREFILL, DECODE]) for _ in groups]
        assert ev.flow_value(groups, phases) == pytest.approx(ev.max_flow(groups, phases).value)


def test_a_groups_nics_are_shared_by_all_its_inter_node_routes():
    # One prefill GPU on one node feeding four decode GPUs on another: four 1-lane routes, but all
    # of them leave through the same single NIC.
    ev = _ev(("h100", 1), ("h100", 4), inter=1.0)
    groups, phases = [[0], [1], [2], [3], [4]], [PREFILL, DECODE, DECODE, DECODE, DECODE]
    assert 4 * ev.route_rate([0], [1]) < ev.evaluate([0]).prefill.rate   # routes alone would allow 4 lanes
    result = ev.max_flow(groups, phases)
    assert result.value == pytest.approx(ev.nic_rate([0]))
    assert ev.flow_value(groups, phases) == pytest.approx(result.value)
    # on one node the same KV moves over the node's links, not the NICs
    local = _ev(("h100", 5), inter=1.0)
    assert local.max_flow(groups, phases).value == pytest.approx(
        min(local.evaluate([0]).prefill.rate, 4 * local.evaluate([1]).decode.rate))
