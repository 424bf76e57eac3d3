"""Planner and simulator benchmark: optimality gap, HexGen-2 setting, planning time, simulator scale.

    python -m loadtest.bench.planner [--out loadtest/results/planner] [--quick]

Writes ``bench_planner.json`` and PNGs (planning time, HexGen-2 ratios, 1,000-GPU utilisation).
Takes about 8 minutes on two cores (the two 1M-request simulations are most of it).
All figures come from Tandem's cost model (no GPUs are used); see the JSON's ``notes``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import numpy as np

from shared.planner.config import MODEL_PRESETS, ClusterSpec, Node, Slo, load_cluster, preset_workload
from shared.planner.devices import Cluster
from shared.planner.exhaustive import exhaustive
from shared.planner.flow import Evaluator
from shared.planner.plan import make_plan
from shared.planner.search import search
from shared.telemetry.plot import figure

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"
INTRA = {"h100": 450, "a100": 300, "l40": 25, "a6000": 25}
TYPES = ["h100", "a100", "l40", "a6000"]
SLO = Slo(ttft_s=3.0, tpot_s=0.1)
WORKLOADS = ["lpld", "lpsd", "spld", "spsd", "mixed"]


def _types() -> dict:
    return load_cluster(EXAMPLES / "het1.yaml").gpu_types


def cluster_of(counts: list[tuple[str, int]], inter_gbps: float = 12.5, per_node: int = 8) -> ClusterSpec:
    nodes = []
    for t, count in counts:
        while count > 0:
            n = min(per_node, count)
            nodes.append(Node(name=f"{t}-{len(nodes)}", gpu_type=t, num_gpus=n, intra_gbps=INTRA[t]))
            count -= n
    return ClusterSpec(gpu_types=_types(), nodes=nodes, inter_node_gbps=inter_gbps)


def bench_exhaustive() -> dict:
    clusters = {"a100x4+l40x4": [("a100", 4), ("l40", 4)], "h100x2+a6000x4": [("h100", 2), ("a6000", 4)],
                "h100x4+a100x2+a6000x2": [("h100", 4), ("a100", 2), ("a6000", 2)],
                "l40x4+a6000x4": [("l40", 4), ("a6000", 4)], "a100x8": [("a100", 8)]}
    rows = []
    for name, counts in clusters.items():
        spec = cluster_of(counts, per_node=4)
        for model in ("llama-2-7b", "opt-30b", "llama-2-70b"):
            for wl in WORKLOADS:
                ev = Evaluator(Cluster(spec), MODEL_PRESETS[model], preset_workload(wl, slo=SLO))
                t0 = time.perf_counter()
                best = exhaustive(ev)
                t1 = time.perf_counter()
                found = search(ev)
                t2 = time.perf_counter()
                gap = 0.0 if best.value == 0 else 1 - found.value / best.value
                rows.append({"cluster": name, "model": model, "workload": wl, "optimum_rps": best.value,
                             "planner_rps": found.value, "gap": gap, "exhaustive_s": t1 - t0, "planner_s": t2 - t1})
    gaps = [r["gap"] for r in rows if r["optimum_rps"] > 0]
    return {"cases": rows, "num_cases": len(gaps), "max_gap": max(gaps), "mean_gap": float(np.mean(gaps)),
            "within_5_percent": sum(g <= 0.05 for g in gaps)}


HET_SETTINGS = {
    "het1": [("h100", 4), ("a100", 4), ("l40", 8)],
    "het2": [("h100", 2), ("a100", 8), ("a6000", 8)],
    "het3": [("a100", 8), ("l40", 8), ("a6000", 4)],
    "het4": [("h100", 4), ("a6000", 16)],
    "het5": [("l40", 8), ("a6000", 16)],
}


def bench_hexgen2(models: list[str], workloads: list[str]) -> dict:
    """Heterogeneous cluster vs the best homogeneous cluster of the same (or lower) hourly price."""
    types = _types()
    rows = []
    for het, counts in HET_SETTINGS.items():
        spec = cluster_of(counts)
        budget = spec.price_per_hour()
        homos = {t: cluster_of([(t, math.floor(budget / types[t].price_per_hour + 1e-9))]) for t in TYPES}
        for model in models:
            for wl in workloads:
                w = preset_workload(wl, slo=SLO)
                het_plan = make_plan(spec, MODEL_PRESETS[model], w)
                homo = {t: make_plan(c, MODEL_PRESETS[model], w).capacity_rps for t, c in homos.items()}
                best_t = max(homo, key=homo.get)
                ratio = het_plan.capacity_rps / homo[best_t] if homo[best_t] > 0 else float("inf")
                vs_h100 = het_plan.capacity_rps / homo["h100"] if homo["h100"] > 0 else float("inf")
                rows.append({"setting": het, "model": model, "workload": wl, "budget_per_hour": budget,
                             "het_rps": het_plan.capacity_rps, "homogeneous_rps": homo,
                             "best_homogeneous": f"{best_t}x{homos[best_t].num_gpus}",
                             "best_homogeneous_price": homos[best_t].price_per_hour(), "ratio": ratio,
                             "ratio_vs_h100": vs_h100})
    summary = {}
    for model in models:
        for key in ("ratio", "ratio_vs_h100"):
            r = [x[key] for x in rows if x["model"] == model and math.isfinite(x[key])]
            summary.setdefault(model, {})[key] = {
                "mean": float(np.mean(r)), "max": max(r), "min": min(r),
                "geomean": float(np.exp(np.mean(np.log(r))))}
    return {"rows": rows, "summary": summary}


def bench_planning_time(sizes: list[int]) -> list[dict]:
    rows = []
    for n in sizes:
        spec = cluster_of([(TYPES[i % 4], 8) for i in range(n // 8)], inter_gbps=25)
        w = preset_workload("mixed", request_rate=n * 0.2, slo=SLO)
        plan = make_plan(spec, MODEL_PRESETS["llama-2-70b"], w)
        rows.append({"num_gpus": n, "planning_s": plan.planning_time_s, "capacity_rps": plan.capacity_rps,
                     "num_workers": len(plan.workers), "refinement_moves": len(plan.search_history) - 1})
        print(f"  planned {n} GPUs in {plan.planning_time_s:.1f} s", flush=True)
    return rows


def bench_simulator(num_requests: int, out: Path) -> dict:
    """1,000 GPUs, ``num_requests`` Poisson requests at 80% of the planned capacity, routed by the
    admission service's rule as is (load in absolute KV blocks) and with load scaled by capacity."""
    from shared.sim.report import plot_utilisation, summarize
    from shared.sim.simulator import SimConfig, Simulator
    from shared.sim.traces import poisson

    spec = cluster_of([(TYPES[i % 4], 8) for i in range(125)], inter_gbps=25)   # 1,000 GPUs
    model = MODEL_PRESETS["llama-2-70b"]
    w = preset_workload("mixed", slo=SLO)
    plan = make_plan(spec, model, w)
    w = w.model_copy(update={"request_rate": 0.8 * plan.capacity_rps})
    trace = poisson(w, num_requests, seed=0)
    runs = {}
    for name, aware in (("routing_as_service", False), ("routing_capacity_aware", True)):
        start = time.perf_counter()
        result = Simulator(Evaluator(Cluster(spec), model, w), plan,
                           SimConfig(capacity_aware_routing=aware)).run(trace)
        wall = time.perf_counter() - start
        plot_utilisation(result, out / f"sim_utilisation_1000gpu_{name}.png",
                         f"llama-2-70b, 1,000 GPUs, {num_requests:,} requests, {name.replace('_', ' ')}")
        runs[name] = {"wall_s": wall, "summary": summarize(result, SLO)}
        print(f"  {name}: {num_requests:,} requests in {wall:.1f} s", flush=True)
    return {"num_gpus": spec.num_gpus, "num_workers": len(plan.workers), "planning_s": plan.planning_time_s,
            "request_rate": w.request_rate, "planned_capacity_rps": plan.capacity_rps,
            "planned_ttft_s": plan.predicted_ttft_s, "planned_tpot_s": plan.predicted_tpot_s, "runs": runs}


def bench_local_prefill(num_requests: int) -> list[dict]:
    """The simulator as a policy test bench: conditional disaggregation thresholds on one plan."""
    from shared.policy.disagg import DisaggConfig
    from shared.sim.report import summarize
    from shared.sim.simulator import SimConfig, Simulator
    from shared.sim.traces import poisson

    spec = cluster_of([(TYPES[i % 4], 8) for i in range(32)], inter_gbps=25)   # 256 GPUs
    model, w = MODEL_PRESETS["llama-2-70b"], preset_workload("mixed", slo=SLO)
    plan = make_plan(spec, model, w)
    rows = []
    for load in (0.5, 0.8):
        wl = w.model_copy(update={"request_rate": load * plan.capacity_rps})
        trace = poisson(wl, num_requests, seed=0)
        for max_local in (0, 512):
            cfg = SimConfig(disagg=DisaggConfig(max_local_prefill_tokens=max_local))
            s = summarize(Simulator(Evaluator(Cluster(spec), model, wl), plan, cfg).run(trace), SLO)
            rows.append({"load_of_planned_capacity": load, "max_local_prefill_tokens": max_local,
                         "offered_rps": wl.request_rate, "goodput_rps": s["goodput_rps"],
                         "slo_attainment": s["slo_attainment"], "ttft_p90_s": s["ttft_s"]["p90"],
                         "tpot_p90_s": s["tpot_s"]["p90"], "rejections": s["rejections"]})
    return rows


def plot(results: dict, out: Path) -> None:
    rows = results["planning_time"]
    with figure(out / "planning_time.png", figsize=(6, 4), dpi=110) as (fig, ax):
        ax.loglog([r["num_gpus"] for r in rows], [r["planning_s"] for r in rows], "o-", label="Tandem planner")
        ax.axhline(30, color="grey", ls="--", label="target at 256 GPUs (30 s)")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("planning time (s)")
        ax.legend()
        ax.set_title("planning time (mixed H100/A100/L40/A6000, Llama-2-70B)")

    hx = results["hexgen2"]["rows"]
    with figure(out / "hexgen2_ratios.png", 1, len(results["hexgen2"]["summary"]), figsize=(11, 4), dpi=110,
                sharey=True) as (fig, axes):
        for ax, model in zip(np.atleast_1d(axes), results["hexgen2"]["summary"]):
            settings = list(HET_SETTINGS)
            for k, wl in enumerate(WORKLOADS):
                vals = [next((r["ratio"] for r in hx
                              if r["model"] == model and r["setting"] == s and r["workload"] == wl), np.nan)
                        for s in settings]
                ax.bar(np.arange(len(settings)) + (k - 2) * 0.16, vals, 0.16, label=wl)
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xticks(range(len(settings)), settings)
            ax.set_title(f"{model}: heterogeneous / best homogeneous")
        np.atleast_1d(axes)[0].set_ylabel("throughput ratio at equal budget")
        np.atleast_1d(axes)[0].legend(fontsize=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="loadtest/results/planner")
    ap.add_argument("--quick", action="store_true", help="small sizes only (for a smoke run)")
    ap.add_argument("--sim-requests", type=int, default=1_000_000)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()}}
    t = time.perf_counter()
    print("exhaustive-search check ...", flush=True)
    results["exhaustive"] = bench_exhaustive()
    print(f"  max gap {results['exhaustive']['max_gap'] * 100:.2f}% over {results['exhaustive']['num_cases']} cases")
    print("HexGen-2 setting ...", flush=True)
    results["hexgen2"] = bench_hexgen2(["llama-2-70b", "opt-30b"], WORKLOADS)
    print("  " + json.dumps(results["hexgen2"]["summary"]))
    print("planning time ...", flush=True)
    results["planning_time"] = bench_planning_time([16, 64] if args.quick else [16, 64, 256, 1024])
    print("conditional disaggregation on a 256-GPU plan ...", flush=True)
    results["local_prefill"] = bench_local_prefill(5_000 if args.quick else 50_000)
    print("simulator at 1,000 GPUs ...", flush=True)
    results["simulator"] = bench_simulator(10_000 if args.quick else args.sim_requests, out)
    results["calibration"] = ("TODO: measure SmolLM2 prefill/decode step times with the real engine, fit them "
                              "with shared.planner.costmodel.calibrate(), and compare simulated TTFT/ITL p50 with "
                              "the running stack under the same load (target within 25%). Not done: the stack "
                              "does not run yet.")
    results["total_s"] = time.perf_counter() - t
    (out / "bench_planner.json").write_text(json.dumps(results, indent=2, default=float))
    plot(results, out)
    print(f"wrote {out}/bench_planner.json, planning_time.png, hexgen2_ratios.png, sim_utilisation_1000gpu_*.png")


if __name__ == "__main__":
    main()
