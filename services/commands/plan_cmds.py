"""`tandem plan` (placement for a heterogeneous cluster) and `tandem simulate` (cluster simulation).

Heavy imports (networkx, numpy, matplotlib) happen inside the command functions.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"TANDEM_{name}", default)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=_env("PLAN_MODEL"),
                   help="model preset (llama-2-70b, llama-2-7b, opt-30b, smollm2-135m) or model YAML "
                        "[env TANDEM_PLAN_MODEL]")
    p.add_argument("--workload", default=_env("PLAN_WORKLOAD", "mixed"),
                   help="workload YAML, or a preset: lpld, lpsd, spld, spsd, mixed [env TANDEM_PLAN_WORKLOAD; "
                        "default mixed]")
    p.add_argument("--rate", type=float, default=None, help="override the workload's request rate (req/s)")
    p.add_argument("--ttft-s", type=float, default=None, help="override the TTFT SLO (seconds)")
    p.add_argument("--tpot-s", type=float, default=None, help="override the TPOT SLO (seconds)")
    p.add_argument("--compute-eff", type=float, default=None, help="cost model: achieved fraction of FLOP/s")
    p.add_argument("--hbm-eff", type=float, default=None, help="cost model: achieved fraction of HBM bandwidth")
    p.add_argument("--calibration", metavar="YAML", default=_env("PLAN_CALIBRATION"),
                   help="measured prefill/decode step times to fit the cost model's efficiencies "
                        "[env TANDEM_PLAN_CALIBRATION]")
    p.add_argument("--seed", type=int, default=0)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="place prefill and decode workers on a (heterogeneous) GPU cluster",
        description="Partition the cluster's GPUs into prefill and decode groups with TP/PP degrees, "
                    "KV routes and predicted throughput, TTFT/TPOT and cost (HexGen-2 style).")
    p.add_argument("cluster", help="cluster YAML (see examples/clusters/)")
    _add_common(p)
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON (for `tandem up` / compose)")
    p.add_argument("--format", choices=["table", "json"], default="table", help="what to print")
    p.set_defaults(func=_plan_cmd)

    s = subparsers.add_parser(
        "simulate", help="simulate a prefill/decode cluster serving a trace (discrete-event)",
        description="Plan the cluster (or load a plan), then replay a Poisson, gamma-bursty or "
                    "Mooncake JSONL trace through the same admission, routing, disaggregation and "
                    "autoscaling policies the services use. Reports goodput, SLO attainment, "
                    "TTFT/TPOT percentiles, per-pool utilisation (PNG) and cost.")
    s.add_argument("cluster", help="cluster YAML")
    _add_common(s)
    s.add_argument("--plan", metavar="PATH", help="plan JSON from `tandem plan --json` (default: plan now)")
    s.add_argument("--trace", default=_env("SIM_TRACE", "poisson"),
                   help="poisson, gamma, or a Mooncake JSONL file [env TANDEM_SIM_TRACE]")
    s.add_argument("--num-requests", type=int, default=int(_env("SIM_NUM_REQUESTS", "10000")),
                   help="synthetic trace length [env TANDEM_SIM_NUM_REQUESTS; default 10000]")
    s.add_argument("--burstiness", type=float, default=3.0, help="gamma trace: inter-arrival CV (default 3)")
    s.add_argument("--autoscale", action="store_true", help="let the autoscaling policy flip roles")
    s.add_argument("--tiers", default=_env("SIM_TIERS", "standard=1"),
                   help="QoS tier mix, e.g. premium=0.2,standard=0.5,batch=0.3 [env TANDEM_SIM_TIERS]")
    s.add_argument("--max-local-prefill", type=int, default=None,
                   help="disaggregation: uncached prompts up to this many tokens prefill on the decode "
                        "worker (default 0: all go to the prefill pool unless its queue is long)")
    s.add_argument("--out", metavar="DIR", default=_env("SIM_OUT"),
                   help="write summary.json and utilisation.png here [env TANDEM_SIM_OUT]")
    s.set_defaults(func=_simulate_cmd)


def _inputs(args):
    from dataclasses import replace

    from services.framework.errors import CliError
    from shared.planner.config import (ConfigError, Slo, load_calibration, load_cluster, load_model,
                                       load_workload)
    from shared.planner.costmodel import DecodeSample, Efficiency, PrefillSample, calibrate

    if not args.model:
        raise CliError("--model is required (a preset name or a model YAML; or set TANDEM_PLAN_MODEL)")
    try:
        cluster = load_cluster(args.cluster)
        model = load_model(args.model)
        workload = load_workload(args.workload, args.rate)
    except ConfigError as exc:
        raise CliError(str(exc)) from exc
    if args.ttft_s or args.tpot_s:
        slo = Slo(ttft_s=args.ttft_s or workload.slo.ttft_s, tpot_s=args.tpot_s or workload.slo.tpot_s)
        workload = workload.model_copy(update={"slo": slo})
    eff = Efficiency()
    if args.calibration:
        try:
            cal = load_calibration(args.calibration)
            base = replace(eff, step_overhead_s=cal.step_overhead_s, prefill_reads_weights=cal.prefill_reads_weights,
                           comm_latency_s=eff.comm_latency_s if cal.comm_latency_s is None else cal.comm_latency_s)
            eff = calibrate(load_model(cal.model), cal.gpu,
                            [PrefillSample(m.num_tokens, m.seconds) for m in cal.prefill],
                            [DecodeSample(m.batch, m.context_len, m.seconds) for m in cal.decode], base,
                            fit_overheads=cal.fit_overheads, seq_undivided_s=cal.decode_seq_undivided_s,
                            prefill_overhead_s=cal.prefill_overhead_s)
        except ConfigError as exc:
            raise CliError(str(exc)) from exc
        print(f"calibrated: compute efficiency {eff.compute:.3f}, HBM efficiency {eff.hbm:.3f}"
              + (f", {eff.step_overhead_s * 1e3:.1f} ms per decode step on every rank" if eff.step_overhead_s else "")
              + (f", {eff.comm_latency_s * 1e6:.0f} us per collective" if cal.comm_latency_s is not None else ""))
    for flag, field in ((args.compute_eff, "compute"), (args.hbm_eff, "hbm")):
        if flag is not None:
            if not 0 < flag <= 1:
                raise CliError(f"--{field}-eff must be in (0, 1], got {flag}")
            eff = replace(eff, **{field: flag})
    return cluster, model, workload, eff


def _plan_cmd(args) -> int:
    from shared.planner.plan import make_plan

    cluster, model, workload, eff = _inputs(args)
    plan = make_plan(cluster, model, workload, eff, seed=args.seed)
    if args.json:
        Path(args.json).write_text(plan.model_dump_json(indent=2))
    print(plan.model_dump_json(indent=2) if args.format == "json" else plan.table())
    return 0


def _load_trace(args, workload):
    from services.framework.errors import CliError
    from shared.sim import traces

    if args.trace == "poisson":
        return traces.poisson(workload, args.num_requests, seed=args.seed)
    if args.trace == "gamma":
        return traces.gamma(workload, args.num_requests, cv=args.burstiness, seed=args.seed)
    if not Path(args.trace).exists():
        raise CliError(f"--trace {args.trace!r}: not poisson, gamma, or an existing Mooncake JSONL file")
    try:
        return traces.load_mooncake(args.trace)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def _tier_mix(text: str) -> tuple[tuple[str, float], ...]:
    from services.framework.errors import CliError
    from shared.sim.simulator import workload_admission

    known = workload_admission(1.0).qos.tiers
    mix = []
    for part in text.split(","):
        name, _, share = part.partition("=")
        try:
            value = float(share)
        except ValueError:
            raise CliError(f"--tiers: {part!r} is not tier=share") from None
        if name.strip() not in known or value <= 0:
            raise CliError(f"--tiers: {part!r}: tiers are {sorted(known)} with shares > 0")
        mix.append((name.strip(), value))
    return tuple(mix)


def _simulate_cmd(args) -> int:
    import json
    import time
    from dataclasses import replace

    from pydantic import ValidationError

    from services.framework.errors import CliError
    from shared.planner.devices import Cluster
    from shared.planner.flow import Evaluator
    from shared.planner.plan import Plan, make_plan
    from shared.policy.autoscale import AutoscaleConfig
    from shared.sim.report import format_summary, plot_utilisation, summarize
    from shared.sim.simulator import SimConfig, Simulator

    cluster, model, workload, eff = _inputs(args)
    if args.plan:
        try:
            plan = Plan.model_validate_json(Path(args.plan).read_text())
        except (OSError, ValidationError) as exc:
            raise CliError(f"--plan {args.plan}: not a readable plan ({str(exc).splitlines()[0]})") from exc
    else:
        plan = make_plan(cluster, model, workload, eff, seed=args.seed)
        print(f"planned {len(plan.workers)} workers, capacity {plan.capacity_rps:.2f} req/s "
              f"in {plan.planning_time_s:.1f} s")
    trace = _load_trace(args, workload)
    cfg = SimConfig(autoscale=AutoscaleConfig() if args.autoscale else None, tier_mix=_tier_mix(args.tiers),
                    seed=args.seed)
    if args.max_local_prefill is not None:
        cfg = replace(cfg, disagg=replace(cfg.disagg, max_local_prefill_tokens=args.max_local_prefill))
    try:
        sim = Simulator(Evaluator(Cluster(cluster), model, workload, eff), plan, cfg, block_size=trace.block_size)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    start = time.perf_counter()
    result = sim.run(trace)
    summary = summarize(result, workload.slo) | {"wall_s": time.perf_counter() - start}
    print(format_summary(summary))
    print(f"simulated {len(trace):,} requests ({summary['num_events']:,} events) in {summary['wall_s']:.1f} s")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        plot_utilisation(result, out / "utilisation.png", f"{model.name} on {plan.num_gpus} GPUs")
        print(f"wrote {out / 'summary.json'} and {out / 'utilisation.png'}")
    return 0
