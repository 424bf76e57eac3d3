"""The planner's output: workers (role, GPUs, TP/PP), KV routes with flow rates, predictions, cost.

``Plan`` is JSON that ``tandem up`` and ``compose/`` can read: one entry per worker with its role
and parallelism. :func:`make_plan` is the planner's entry point.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict

from shared.planner.config import ClusterSpec, ModelSpec, Slo, WorkloadSpec
from shared.planner.costmodel import Efficiency, decode_step_s, kv_transfer_s, prefill_service_s
from shared.planner.devices import Cluster
from shared.planner.flow import DECODE, IDLE, PREFILL, Evaluator
from shared.planner.search import State, search


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class WorkerPlan(_Out):
    worker_id: str
    role: Literal["prefill", "decode", "idle"]
    gpu_type: str                 # the slowest type in the group (sets the pace)
    gpus: list[str]               # "node/gpuN"
    tp: int
    pp: int
    capacity_rps: float           # within SLO
    assigned_rps: float           # at the offered rate
    latency_s: float              # at load: prefill latency + queueing of a mean prompt, or decode step
    batch: float = 0.0            # mean decode batch at load
    price_per_hour: float


class RoutePlan(_Out):
    prefill_worker: str
    decode_worker: str
    rate_rps: float
    route_gbps: float
    transfer_s: float


class Plan(_Out):
    version: int = 1
    model: str
    num_gpus: int
    request_rate: float
    mean_input_len: float
    mean_output_len: float
    slo: Slo
    workers: list[WorkerPlan]
    routes: list[RoutePlan]
    capacity_rps: float           # max-flow: the most the plan serves within SLO
    throughput_rps: float         # min(offered rate, capacity)
    output_tokens_per_s: float
    predicted_ttft_s: float | None   # flow-weighted mean, at the offered rate (None: serves nothing)
    predicted_tpot_s: float | None
    cost_per_hour: float          # every GPU of the cluster, used or not
    cost_per_million_output_tokens: float | None
    planning_time_s: float
    search_history: list[str]

    def table(self) -> str:
        lines = [f"{'worker':<10} {'role':<8} {'gpu':<8} {'#':>3} {'tp':>3} {'pp':>3} "
                 f"{'cap r/s':>9} {'load r/s':>9} {'latency':>9}  gpus"]
        for w in self.workers:
            gpus = ",".join(w.gpus) if len(w.gpus) <= 4 else f"{w.gpus[0]}..{w.gpus[-1]}"
            lines.append(f"{w.worker_id:<10} {w.role:<8} {w.gpu_type:<8} {len(w.gpus):>3} {w.tp:>3} {w.pp:>3} "
                         f"{w.capacity_rps:>9.3f} {w.assigned_rps:>9.3f} {w.latency_s * 1e3:>7.1f}ms  {gpus}")
        lines.append("")
        lines.append(f"routes: {len(self.routes)} (prefill -> decode, r/s): " + ", ".join(
            f"{r.prefill_worker}->{r.decode_worker} {r.rate_rps:.2f}" for r in self.routes[:12])
            + (" ..." if len(self.routes) > 12 else ""))
        lines.append(f"capacity {self.capacity_rps:.2f} req/s within SLO; serving {self.throughput_rps:.2f} "
                     f"of {self.request_rate:.2f} offered ({self.output_tokens_per_s:,.0f} output tok/s)")
        if self.predicted_ttft_s is None or self.predicted_tpot_s is None:
            lines.append("nothing can be served within the SLOs on this cluster")
        else:
            lines.append(f"predicted TTFT {self.predicted_ttft_s * 1e3:.0f} ms (SLO {self.slo.ttft_s * 1e3:.0f}), "
                         f"TPOT {self.predicted_tpot_s * 1e3:.1f} ms (SLO {self.slo.tpot_s * 1e3:.0f})")
        per_token = ("n/a" if self.cost_per_million_output_tokens is None
                     else f"${self.cost_per_million_output_tokens:.3f}")
        lines.append(f"cost ${self.cost_per_hour:.2f}/h, {per_token} per 1M output tokens; "
                     f"planned in {self.planning_time_s:.2f} s")
        return "\n".join(lines)


def _decode_at_load(ev: Evaluator, group: list[int], par, rate: float, cap_batch: int) -> tuple[float, float]:
    """Mean batch and step time at ``rate`` (Little's law: B = rate · output_len · step(B))."""
    hw, ctx = ev.cluster.hardware(group), ev.input_len + ev.output_len / 2
    batch = 1.0
    for _ in range(50):
        batch = min(max(rate * ev.output_len * decode_step_s(ev.model, hw, par, ev.eff, batch, ctx), 1.0), cap_batch)
    return batch, decode_step_s(ev.model, hw, par, ev.eff, batch, ctx)


def _worker_names(phases: list[str]) -> dict[int, str]:
    names: dict[int, str] = {}
    for kind in (PREFILL, DECODE, IDLE):
        for i, ph in enumerate(phases):
            if ph == kind:
                names[i] = f"{kind}-{sum(1 for n in names.values() if n.startswith(kind))}"
    return names


def _worker(ev: Evaluator, group: list[int], phase: str, name: str, load: float) -> WorkerPlan:
    """One worker's entry, with its latency at ``load``: prefill latency of a mean prompt plus
    M/D/1 queueing, or the decode step time at the Little's-law batch."""
    e, hw = ev.evaluate(group), ev.cluster.hardware(group)
    par = e.prefill_par if phase == PREFILL else e.decode_par
    latency, batch = 0.0, 0.0
    if phase == PREFILL:
        mu = 1.0 / prefill_service_s(ev.model, hw, par, ev.eff, ev.input_len)
        rho = min(load / mu, 0.999)
        latency = e.prefill.latency_s + rho / (2 * mu * (1 - rho))
    elif phase == DECODE:
        batch, latency = _decode_at_load(ev, group, par, load, e.decode.batch)
    slowest = min({ev.cluster.devices[d].gpu_type for d in group}, key=lambda t: ev.cluster.gpu_type(t).tflops_bf16)
    return WorkerPlan(worker_id=name, role=phase, gpu_type=slowest,
                      gpus=[ev.cluster.devices[d].label(ev.cluster.spec) for d in group],
                      tp=par.tp if par else 1, pp=par.pp if par else len(group), capacity_rps=e.rate(phase),
                      assigned_rps=load, latency_s=latency, batch=batch, price_per_hour=hw.price_per_hour)


def build_plan(ev: Evaluator, state: State, planning_time_s: float) -> Plan:
    # A group labelled with a phase it cannot serve (zero capacity) is idle in the output.
    phases = [ph if ev.evaluate(g).rate(ph) > 0 else IDLE for g, ph in zip(state.groups, state.phases)]
    flow = ev.max_flow(state.groups, phases)
    served = min(ev.workload.request_rate, flow.value)
    scale = served / flow.value if flow.value > 0 else 0.0   # routes carry the offered load
    names = _worker_names(phases)
    load = {i: 0.0 for i in range(len(state.groups))}
    routes = []
    for (i, j), rate in sorted(flow.routes.items()):
        load[i] += rate * scale
        load[j] += rate * scale
        gbps = ev.cluster.route_gbps(state.groups[i], state.groups[j])
        routes.append(RoutePlan(prefill_worker=names[i], decode_worker=names[j], rate_rps=rate * scale,
                                route_gbps=gbps, transfer_s=kv_transfer_s(ev.model, ev.input_len, gbps, ev.eff)))
    workers = [_worker(ev, state.groups[i], phases[i], names[i], load[i]) for i in sorted(names, key=names.get)]
    ttft = sum(r.rate_rps * r.transfer_s for r in routes) + sum(
        w.assigned_rps * w.latency_s for w in workers if w.role == PREFILL)
    tpot = sum(w.assigned_rps * w.latency_s for w in workers if w.role == DECODE)
    cost, out_tps = ev.cluster.spec.price_per_hour(), served * ev.output_len
    return Plan(
        model=ev.model.name, num_gpus=len(ev.cluster), request_rate=ev.workload.request_rate,
        mean_input_len=ev.input_len, mean_output_len=ev.output_len, slo=ev.workload.slo,
        workers=workers, routes=routes, capacity_rps=flow.value, throughput_rps=served,
        output_tokens_per_s=out_tps, predicted_ttft_s=ttft / served if served else None,
        predicted_tpot_s=tpot / served if served else None, cost_per_hour=cost,
        cost_per_million_output_tokens=cost / (out_tps * 3600) * 1e6 if out_tps else None,
        planning_time_s=planning_time_s, search_history=state.history)


def make_plan(cluster: ClusterSpec, model: ModelSpec, workload: WorkloadSpec,
              eff: Efficiency = Efficiency(), seed: int = 0, max_rounds: int = 50) -> Plan:
    start = time.perf_counter()
    ev = Evaluator(Cluster(cluster), model, workload, eff)
    state = search(ev, max_rounds=max_rounds, seed=seed)
    return build_plan(ev, state, time.perf_counter() - start)
