"""A plan as the workers tandem up starts (shared/planner/launch.py): each planned worker under
tandem up's name with its parallel shape and device, or the plan refused naming the worker."""

from __future__ import annotations

import pytest

from shared.planner.config import MODEL_PRESETS, Slo
from shared.planner.costmodel import parallel_options
from shared.planner.launch import PlanNotRunnable, PlannedRanks, host_share, workers_from_plan
from shared.planner.plan import Plan, WorkerPlan


def worker(worker_id: str, role: str, gpus: list[str], tp: int = 1, pp: int = 1) -> WorkerPlan:
    return WorkerPlan(worker_id=worker_id, role=role, gpu_type="cpu", gpus=gpus, tp=tp, pp=pp, capacity_rps=1.0,
                      assigned_rps=1.0, latency_s=0.1, price_per_hour=0.0)


def plan(*workers: WorkerPlan) -> Plan:
    return Plan(model="smollm2-135m", num_gpus=sum(len(w.gpus) for w in workers), request_rate=1.0,
                mean_input_len=100, mean_output_len=100, slo=Slo(ttft_s=5, tpot_s=0.1), workers=list(workers),
                routes=[], capacity_rps=1.0, throughput_rps=1.0, output_tokens_per_s=100.0, predicted_ttft_s=0.1,
                predicted_tpot_s=0.05, cost_per_hour=0.0, cost_per_million_output_tokens=None, planning_time_s=0.0,
                search_history=[])


def test_each_planned_worker_gets_its_shape_under_tandem_ups_name():
    p = plan(worker("d0", "decode", ["host/gpu0", "host/gpu1", "host/gpu2"], tp=3),
             worker("p0", "prefill", ["host/gpu3"]), worker("idle0", "idle", ["host/gpu6"]),
             worker("d1", "decode", ["host/gpu4", "host/gpu5"], pp=2))
    got = [(w.name, w.plan_id, w.role, w.flags) for w in workers_from_plan(p, "cpu")]
    assert got == [("decode-1", "d0", "decode", {"tensor_parallel_size": 3}),
                   ("decode-2", "d1", "decode", {"pipeline_parallel_size": 2}),
                   ("prefill-1", "p0", "prefill", {})]
    on_gpus = {w.name: w.flags["device"] for w in workers_from_plan(p, "cuda")}
    assert on_gpus == {"decode-1": "cuda:0", "decode-2": "cuda:4", "prefill-1": "cuda:3"}


@pytest.mark.parametrize("workers,message", [
    ([worker("d0", "decode", ["a/gpu0"]), worker("d1", "decode", ["b/gpu0"])], r"on 2 nodes \(a, b\)"),
    ([worker("p0", "prefill", ["a/gpu1"])], "no decode worker"),
])
def test_a_plan_this_host_cannot_run_is_refused_naming_the_worker(workers, message):
    with pytest.raises(PlanNotRunnable, match=message):
        workers_from_plan(plan(*workers), "cpu")


def test_a_prefill_worker_of_several_ranks_starts_with_its_own_shape():
    p = plan(worker("d0", "decode", ["a/gpu0"]), worker("p0", "prefill", ["a/gpu1", "a/gpu2"], tp=2))
    assert [(w.name, w.flags) for w in workers_from_plan(p, "cpu")] == [
        ("decode-1", {}), ("prefill-1", {"tensor_parallel_size": 2})]


def test_gpus_of_a_group_must_be_consecutive_on_cuda():
    p = plan(worker("d0", "decode", ["a/gpu0", "a/gpu2"], tp=2))
    assert workers_from_plan(p, "cpu")[0].flags == {"tensor_parallel_size": 2}
    with pytest.raises(PlanNotRunnable, match="d0: its GPUs .* are not consecutive"):
        workers_from_plan(p, "cuda")


def test_the_planner_offers_only_shapes_a_worker_can_start_with():
    smol = MODEL_PRESETS["smollm2-135m"]  # 9 heads, 3 KV heads: no power-of-two TP above 1
    assert [(p.tp, p.pp) for p in parallel_options(4, 8, smol)] == [(1, 4)]
    llama = MODEL_PRESETS["llama-2-70b"]  # 64 heads, 8 KV heads
    assert [(p.tp, p.pp) for p in parallel_options(8, 8, llama)] == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert [(p.tp, p.pp) for p in parallel_options(8, 8)] == [(1, 8), (2, 4), (4, 2), (8, 1)]


def two_node_plan() -> Plan:
    """d0 on a; d1's ranks on a then b (led from a); p0 on b; d2's ranks on b then a (led from b)."""
    return plan(worker("d0", "decode", ["a/gpu0", "a/gpu1"], tp=2), worker("d1", "decode", ["a/gpu2", "b/gpu0"], pp=2),
                worker("p0", "prefill", ["b/gpu1"]), worker("d2", "decode", ["b/gpu2", "b/gpu3", "a/gpu3"], tp=3))


def test_each_node_of_a_plan_starts_the_workers_it_leads_and_its_ranks_of_the_others():
    a, b = (host_share(two_node_plan(), "cuda", node) for node in ("a", "b"))
    assert [(w.name, w.plan_id, w.flags, w.group_index) for w in a.workers] == [
        ("decode-1", "d0", {"tensor_parallel_size": 2, "device": "cuda:0"}, None),
        ("decode-2", "d1", {"pipeline_parallel_size": 2, "device": "cuda:2", "group_local_ranks": 1}, 0)]
    assert a.ranks == [PlannedRanks("d2", "b", 0, 2, ["cuda:3"])]  # d2's rank 2, on a's gpu3
    assert [(w.name, w.plan_id, w.flags, w.group_index) for w in b.workers] == [
        ("decode-1", "d2", {"tensor_parallel_size": 3, "device": "cuda:2", "group_local_ranks": 2}, 0),
        ("prefill-1", "p0", {"device": "cuda:1"}, None)]
    assert b.ranks == [PlannedRanks("d1", "a", 0, 1, ["cuda:0"])]
    with pytest.raises(PlanNotRunnable, match="give --plan-node"):
        host_share(two_node_plan(), "cpu")
    with pytest.raises(PlanNotRunnable, match="--plan-node c: the plan's nodes are a, b"):
        host_share(two_node_plan(), "cpu", "c")


def test_a_workers_ranks_on_one_node_must_be_consecutive():
    p = plan(worker("d0", "decode", ["a/gpu0", "b/gpu0", "a/gpu1"], tp=3))
    with pytest.raises(PlanNotRunnable, match="d0: its ranks on node a are not consecutive"):
        host_share(p, "cpu", "b")
