"""A simulated replay: the same requests through ``shared.sim.Simulator`` on a planned GPU cluster
or on this machine's calibrated CPU model."""

from __future__ import annotations

import math
import time
from pathlib import Path

from loadtest.tools.replay.summary import Outcome
from loadtest.tools.replay.trace import ReplayRequest, TierSpec, scaled_block_tokens


def parse_bytes(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[:-len(u)]) * m)
    return int(float(t))


def _trace_of(requests: list[ReplayRequest], block_tokens: int):
    import numpy as np

    from shared.sim.traces import Trace

    return Trace(np.array([r.at_s for r in requests], dtype=float),
                 np.array([r.input_tokens for r in requests], dtype=np.int64),
                 np.array([r.output_tokens for r in requests], dtype=np.int64),
                 [list(r.hash_ids) for r in requests], block_tokens, tiers=[r.tier for r in requests])


def _admission(tiers: list[TierSpec], with_slos: bool):
    from shared.policy.admission import AdmissionConfig
    from shared.policy.qos import QosConfig, QosTier

    return AdmissionConfig(QosConfig(default_tier=tiers[-1].name, tiers={
        t.name: QosTier(priority=k, ttft_slo_ms=t.ttft_slo_s * 1000 if with_slos else None)
        for k, t in enumerate(tiers)}), min_retry_after_s=0.0)


def _routing(mode: str):
    from shared.policy.kv_routing import RoutingWeights

    return RoutingWeights(overlap_weight=0.0) if mode == "load" else RoutingWeights()


def _workload(requests: list[ReplayRequest], tiers: list[TierSpec]):
    import numpy as np

    from shared.planner.config import Slo, WorkloadSpec

    inp = np.array([r.input_tokens for r in requests], dtype=float)
    span = max(requests[-1].at_s - requests[0].at_s, 1e-3) if len(requests) > 1 else 1.0
    tpot = min((t.tpot_slo_s for t in tiers if t.tpot_slo_s), default=None)
    return WorkloadSpec(request_rate=max(len(requests) / span, 1e-6), input_len=max(1, round(inp.mean())),
                        output_len=max(1, round(float(np.mean([r.output_tokens for r in requests])))),
                        length_cv=float(inp.std() / inp.mean()) if inp.mean() else 0.0,
                        slo=Slo(ttft_s=min(t.ttft_slo_s for t in tiers) if all(math.isfinite(t.ttft_slo_s)
                                                                                for t in tiers) else 60.0,
                                tpot_s=tpot or 1.0))


def gpu_setup(requests, tiers, args):
    """(Evaluator, Plan, SimConfig) for the GPU cluster, planned for the slice."""
    from shared.planner.config import load_cluster, load_model
    from shared.planner.costmodel import Efficiency
    from shared.planner.devices import Cluster
    from shared.planner.flow import Evaluator
    from shared.planner.plan import Plan, make_plan
    from shared.sim.simulator import SimConfig

    cluster, model, workload = load_cluster(args.cluster), load_model(args.model), _workload(requests, tiers)
    eff = Efficiency()
    plan = (Plan.model_validate_json(Path(args.plan).read_text()) if args.plan
            else make_plan(cluster, model, workload, eff, seed=args.seed))
    if args.prefill_workers is not None:
        plan = with_prefill_workers(plan, args.prefill_workers)
    cfg = SimConfig(routing=_routing(args.routing), admission=_admission(tiers, args.admission),
                    round_robin=args.routing == "round-robin", seed=args.seed,
                    prefix_cache_blocks=args.prefix_cache_blocks, fallback_workers=args.fallback_workers,
                    peer_fetch=_peer_fetch(args),
                    autoscale=_autoscale(args), autoscale_window_s=args.autoscale_window_s)
    return Evaluator(Cluster(cluster), model, workload, eff), plan, cfg


def _autoscale(args, **bounds):
    """The simulated autoscaler's policy settings (None: roles stay as set), as the service's flags."""
    from shared.policy.autoscale import AutoscaleConfig

    if not args.autoscale:
        return None
    return AutoscaleConfig(cooldown_s=args.autoscale_cooldown_s, stabilization_s=args.autoscale_stabilization_s,
                           **bounds)


def _peer_fetch(args):
    """The simulated decode workers' peer fetch: on, as the engine's default, unless --no-kv-peer-fetch."""
    from shared.policy.kv_fetch import FetchConfig

    return FetchConfig() if args.kv_peer_fetch else None


def cpu_setup(requests, tiers, args):
    """(Evaluator, Plan, SimConfig): ``args.decode`` decode workers on this machine, as ``tandem up``
    runs them, timed by the fitted CPU cost model."""
    from dataclasses import replace as dc_replace

    from shared.planner.config import GpuType, load_calibration, load_model
    from shared.planner.costmodel import DecodeSample, PrefillSample, calibrate
    from shared.planner.config import ClusterSpec
    from shared.planner.devices import Cluster
    from shared.planner.flow import Evaluator
    from shared.planner.plan import Plan, WorkerPlan
    from shared.policy.disagg import DisaggConfig
    from shared.sim.simulator import SimConfig

    cal = load_calibration(Path(args.calibration_dir) / "smollm2-cpu.yaml")
    model = load_model(cal.model)
    eff = calibrate(model, cal.gpu, [PrefillSample(m.num_tokens, m.seconds) for m in cal.prefill],
                    [DecodeSample(m.batch, m.context_len, m.seconds) for m in cal.decode], fit_overheads=True)
    num_prefill = args.prefill_workers or 0
    num_workers = args.decode + num_prefill
    share = args.cpu_share if args.cpu_share is not None else 1.0 / num_workers
    # the workers split the CPU: each runs at ``share`` of the measured speed (overheads included)
    eff = dc_replace(eff, compute=eff.compute * share, hbm=eff.hbm * share,
                     prefill_overhead_s=eff.prefill_overhead_s / share, decode_seq_s=eff.decode_seq_s / share)
    kv_bytes = parse_bytes(args.kv_cache_memory or "1GiB")
    hbm_gib = (kv_bytes + model.weight_bytes) / eff.mem_fraction / (1 << 30)
    gpu = GpuType(tflops_bf16=cal.gpu.tflops_bf16, hbm_gib=hbm_gib, hbm_gbps=cal.gpu.hbm_gbps, price_per_hour=0.0)
    spec = ClusterSpec(gpu_types={"cpu": gpu}, inter_node_gbps=1.0,
                       nodes=[{"name": "local", "gpu_type": "cpu", "num_gpus": num_workers, "intra_gbps": 1.0}])
    workload = _workload(requests, tiers)
    any_prefill = bool(num_prefill or args.autoscale)   # a worker prefills now, or may after a flip
    if any_prefill:
        # a worker's prefill capacity is taken at the loosest tier's TTFT: at its share of the CPU a
        # long prompt of the slice misses the tightest one alone, and the cost model then gives a
        # worker no prefill capacity at all (it could neither prefill nor flip to it)
        loosest = max(t.ttft_slo_s for t in tiers)
        if math.isfinite(loosest):
            workload = workload.model_copy(update={"slo": workload.slo.model_copy(update={"ttft_s": loosest})})
    rate = workload.request_rate
    roles = ["decode"] * args.decode + ["prefill"] * num_prefill
    numbers = {"decode": iter(range(1, args.decode + 1)), "prefill": iter(range(1, num_prefill + 1))}
    plan = Plan(model=model.name, num_gpus=num_workers, request_rate=rate, mean_input_len=workload.input_len,
                mean_output_len=workload.output_len, slo=workload.slo,
                workers=[WorkerPlan(worker_id=f"{role}-{next(numbers[role])}", role=role, gpu_type="cpu",
                                    gpus=[f"local/gpu{k}"], tp=1, pp=1, capacity_rps=0.0,
                                    assigned_rps=rate / num_workers, latency_s=0.0, price_per_hour=0.0)
                         for k, role in enumerate(roles)],
                routes=[], capacity_rps=0.0, throughput_rps=rate, output_tokens_per_s=rate * workload.output_len,
                predicted_ttft_s=None, predicted_tpot_s=None, cost_per_hour=0.0,
                cost_per_million_output_tokens=None, planning_time_s=0.0, search_history=[])
    # decode workers prefill locally up to the engine's threshold, as live (with no prefill worker, all)
    disagg = DisaggConfig() if any_prefill else DisaggConfig(max_local_prefill_tokens=1 << 30)
    cfg = SimConfig(disagg=disagg, routing=_routing(args.routing),
                    admission=_admission(tiers, args.admission), round_robin=args.routing == "round-robin",
                    fallback_workers=args.fallback_workers, peer_fetch=_peer_fetch(args),
                    max_num_seqs=args.max_num_seqs, local_prefill_batch_tokens=args.max_num_batched_tokens,
                    seed=args.seed, prefix_cache_blocks=cpu_prefix_cache_blocks(args, model, kv_bytes),
                    autoscale=_autoscale(args, min_prefill=0, min_decode=1), autoscale_window_s=args.autoscale_window_s)
    return Evaluator(Cluster(spec), model, workload, eff), plan, cfg


def cpu_prefix_cache_blocks(args, model, pool_bytes: int) -> int | None:
    """The simulated prefix cache per worker: ``--prefix-cache-blocks``, or with ``--kv-host-memory``
    the pool's blocks and the host tier's together, as a cache of its own beside the running
    requests (the live pool sends what it evicts to the host tier and copies it back on a hit, so
    what it can hold is about both; the copy back is not timed; ``pool_bytes``: the pool's size).
    None: the pool's free part."""
    if args.prefix_cache_blocks is not None or not args.kv_host_memory:
        return args.prefix_cache_blocks
    block_bytes = model.kv_bytes_per_token() * scaled_block_tokens(args.length_scale)
    return int((pool_bytes + parse_bytes(args.kv_host_memory)) // block_bytes)


def with_prefill_workers(plan, num_prefill: int):
    """``plan`` with ``num_prefill`` of its groups prefilling and the rest decoding (a fixed split):
    planned prefill groups stay prefill first, then planned decode groups are added (or, for fewer,
    planned prefill groups decode, the last first). The groups and their GPUs stay as planned."""
    active = [w for w in plan.workers if w.role != "idle"]
    if not 1 <= num_prefill < len(active):
        raise SystemExit(f"--prefill-workers {num_prefill}: the plan has {len(active)} groups (at least one "
                         "must decode)")
    order = [w for w in active if w.role == "prefill"] + [w for w in reversed(active) if w.role == "decode"]
    prefill = {w.worker_id for w in order[:num_prefill]}
    workers = [w if w.role == "idle" else w.model_copy(update={"role": "prefill" if w.worker_id in prefill
                                                                else "decode"}) for w in plan.workers]
    return plan.model_copy(update={"workers": workers})


def run_sim(requests: list[ReplayRequest], tiers: list[TierSpec], args) -> tuple[list[Outcome], dict]:
    """Simulate ``requests``; their outcomes and what the run was (setup, workers, wall time)."""
    import numpy as np

    from shared.sim.simulator import Simulator

    ev, plan, cfg = (gpu_setup if args.simulate == "gpu" else cpu_setup)(requests, tiers, args)
    block = scaled_block_tokens(args.length_scale)
    trace = _trace_of(requests, block)
    t0 = time.perf_counter()
    sim = Simulator(ev, plan, cfg, block_size=block)
    res = sim.run(trace)
    wall = time.perf_counter() - t0
    outcomes = []
    for k, r in enumerate(requests):
        if res.rejected[k]:
            outcomes.append(Outcome(r.index, r.tier, "rejected", r.at_s))
            continue
        ttft, tpot, fin = float(res.ttft_s[k]), float(res.tpot_s[k]), float(res.finish_s[k])
        done = not np.isnan(fin)
        outcomes.append(Outcome(r.index, r.tier, "ok" if done else "failed", r.at_s, ttft, tpot, fin - r.at_s, fin,
                                [],
                                r.input_tokens, int(res.cached_tokens[k]), r.output_tokens,
                                error=None if done else "not finished"))
    workers = [{"name": w.worker_id, "role": w.role, "gpus": w.gpus, "tp": w.tp, "pp": w.pp} for w in plan.workers]
    info = {"setup": args.simulate, "wall_s": wall, "num_events": res.num_events, "workers": workers,
            "num_gpus": plan.num_gpus, "rejections": dict(res.rejections), "itl_is_tpot": True,
            "admitted_elsewhere": res.admitted_elsewhere, "peer_fetches": res.num_fetches,
            "flips": res.flips, "num_prefill_over_time": [[t, n] for t, n in zip(res.tick_s, res.num_prefill)],
            "model": ev.model.name, "block_tokens": block,
            "kv_capacity_tokens": [float(w.kv_capacity) for w in sim.workers]}
    return outcomes, info
