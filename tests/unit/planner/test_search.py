"""The planner against exhaustive search (<= 8 GPUs, same cost model): within 5% of the optimum."""

import pytest

from shared.planner.config import MODEL_PRESETS, Slo, preset_workload
from shared.planner.devices import Cluster
from shared.planner.exhaustive import exhaustive, set_partitions
from shared.planner.flow import DECODE, IDLE, PREFILL, Evaluator
from shared.planner.plan import Plan, build_plan, make_plan
from shared.planner.search import search

from planner_helpers import make_cluster

CLUSTERS = {
    "a100x4+l40x4": [("a100", 4), ("l40", 4)],
    "h100x2+a6000x4": [("h100", 2), ("a6000", 4)],
    "l40x2+l40x2+a100x2": [("l40", 2), ("l40", 2), ("a100", 2)],
    "h100x4+a100x2+a6000x2": [("h100", 4), ("a100", 2), ("a6000", 2)],
}
CASES = [(c, m, w) for c in CLUSTERS for m, w in
         [("llama-2-7b", "mixed"), ("llama-2-7b", "spld"), ("opt-30b", "lpsd"), ("llama-2-70b", "mixed"),
          ("llama-2-70b", "spld")]]   # the last needs 3-GPU groups: only device moves reach them


def test_set_partitions_counts_are_bell_numbers():
    assert [sum(1 for _ in set_partitions(list(range(n)))) for n in range(1, 7)] == [1, 2, 5, 15, 52, 203]


@pytest.mark.parametrize("cluster,model,workload", CASES)
def test_planner_within_5_percent_of_exhaustive(cluster, model, workload):
    ev = Evaluator(Cluster(make_cluster(*CLUSTERS[cluster])), MODEL_PRESETS[model], preset_workload(workload))
    best = exhaustive(ev)
    found = search(ev)
    assert best.value > 0
    assert found.value >= 0.95 * best.value, (found.groups, found.phases, best.groups, best.phases)
    assert found.value <= best.value * (1 + 1e-9)   # exhaustive really is the optimum


def test_planned_groups_are_disjoint_and_cover_the_cluster():
    ev = Evaluator(Cluster(make_cluster(("a100", 8), ("l40", 8), ("h100", 8))), MODEL_PRESETS["opt-30b"],
                   preset_workload("mixed"))
    s = search(ev)
    used = sorted(d for g in s.groups for d in g)
    assert used == list(range(24))
    assert set(s.phases) <= {PREFILL, DECODE, IDLE} and PREFILL in s.phases and DECODE in s.phases


def test_plan_output_is_consistent_and_round_trips():
    spec = make_cluster(("a100", 4), ("l40", 4))
    workload = preset_workload("mixed", request_rate=2.0, slo=Slo(ttft_s=3, tpot_s=0.1))
    plan = make_plan(spec, MODEL_PRESETS["llama-2-7b"], workload)
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    for w in plan.workers:
        assert w.tp * w.pp == len(w.gpus)
    assert sum(r.rate_rps for r in plan.routes) == pytest.approx(plan.throughput_rps)
    assert plan.throughput_rps == pytest.approx(min(2.0, plan.capacity_rps))
    assert plan.predicted_ttft_s <= 3 and plan.predicted_tpot_s <= 0.1
    assert plan.cost_per_hour == pytest.approx(4 * 2.0 + 4 * 1.1)
    table = plan.table()
    assert "prefill-0" in table and "decode-0" in table and "req/s" in table


def test_nothing_fits_gives_an_empty_plan():
    ev = Evaluator(Cluster(make_cluster(("l40", 1))), MODEL_PRESETS["llama-2-70b"], preset_workload("mixed"))
    state = search(ev)
    assert state.value == 0
    plan = build_plan(ev, state, 0.0)
    assert plan.capacity_rps == 0 and all(w.role == "idle" for w in plan.workers)
    assert plan.predicted_ttft_s is None and Plan.model_validate_json(plan.model_dump_json()) == plan
    assert "nothing can be served" in plan.table()


def test_exhaustive_refuses_big_clusters():
    ev = Evaluator(Cluster(make_cluster(("a100", 8), ("a100", 1))), MODEL_PRESETS["llama-2-7b"],
                   preset_workload("mixed"))
    with pytest.raises(ValueError, match="<= 8 GPUs"):
        exhaustive(ev)
