"""The simulator against the live stack under overload with two QoS tiers: goodput and per-tier SLO
attainment, side by side (issue 11: the simulator runs the same admission and autoscaling code).

    python -m loadtest.calibrate.overload [--loads 3 --duration-s 30 --premium-share 0.3]

The simulator uses the cost model fitted by ``loadtest.calibrate.sim`` (its committed calibration
files: this machine's measured step times) and the same ``shared.policy.admission.Admitter`` with
the same tiers as the live stack. The live side is ``loadtest.bench.overload``'s stack with
admission control on (one decode worker), its capacity measured by a saturating burst; each load
is a multiple of it and both sides get the same arrival schedule, lengths and tiers, request for
request. The simulator's prefill queues serve by priority, then arrival, as the engine does.
Writes ``calibration_overload.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np

from loadtest.bench import overload as bench
from loadtest.calibrate.sim import CALIBRATION_FILE, CLUSTER_FILE, relative_error, simulate
from shared.engine.config import EngineConfig
from shared.telemetry.measure import meets_slo_array

CALIBRATION_DIR = Path("loadtest/results/calibration")
ENGINE_DEFAULTS = EngineConfig()  # the live decode worker's step budget


def fitted_model(calibration_dir: Path = CALIBRATION_DIR):
    from shared.planner.config import load_calibration, load_model
    from shared.planner.costmodel import DecodeSample, PrefillSample, calibrate

    cal = load_calibration(calibration_dir / CALIBRATION_FILE)
    model = load_model(cal.model)
    eff = calibrate(model, cal.gpu, [PrefillSample(m.num_tokens, m.seconds) for m in cal.prefill],
                    [DecodeSample(m.batch, m.context_len, m.seconds) for m in cal.decode], fit_overheads=True)
    return model, eff


def admission(slo_ms: dict[str, float]):
    from shared.policy.admission import AdmissionConfig
    from shared.policy.qos import QosConfig, QosTier

    return AdmissionConfig(QosConfig(default_tier="batch", tiers={
        tier: QosTier(priority=p, ttft_slo_ms=slo_ms[tier]) for tier, p in zip(bench.TIERS, (0, 2))}))


def sim_report(result, slo_s: dict[str, float]) -> dict:
    """bench_overload's tier report, from the simulator's per-request arrays."""
    ok = ~result.rejected
    span = float(np.nanmax(np.where(ok, result.finish_s, np.nan)) - result.arrival_s.min())
    out = {}
    for tier in bench.TIERS:
        mine = result.tier == tier
        good = mine & ok & meets_slo_array(result.ttft_s, None, slo_s[tier])
        n = int(mine.sum())
        out[tier] = {"num_sent": n, "num_ok": int((mine & ok).sum()), "num_good": int(good.sum()),
                     "num_rejected": int((mine & result.rejected).sum()),
                     "slo_attainment": good.sum() / n if n else None}
    out["goodput_rps"] = sum(out[t]["num_good"] for t in bench.TIERS) / max(span, 1e-9)
    return out


def compare(sim: dict, live: dict) -> dict:
    rows = {"goodput_rps": {"sim": sim["goodput_rps"], "live": live["goodput_rps"]}}
    for tier in bench.TIERS:
        rows[f"{tier}_slo_attainment"] = {"sim": sim[tier]["slo_attainment"], "live": live[tier]["slo_attainment"]}
    for row in rows.values():
        row["rel_error"] = relative_error(row["sim"], row["live"]) if row["live"] else None
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--loads", default="3", help="offered loads, multiples of the measured capacity")
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--premium-share", type=float, default=0.3)
    p.add_argument("--premium-slo-ms", type=float, default=2000.0)
    p.add_argument("--batch-slo-ms", type=float, default=8000.0)
    p.add_argument("--premium-itl-slo-ms", type=float, default=None)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument("--capacity-requests", type=int, default=32)
    p.add_argument("--capacity-bursts", type=int, default=3, help="capacity = the median of this many bursts")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("loadtest/results/calibration"))
    p.add_argument("--calibration-dir", type=Path, default=CALIBRATION_DIR,
                   help="where calibrate_sim wrote the step-time calibration and cluster files (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def run_load(stack, args, cfg, m: float, capacity: float, fitted, tokenizer, slo_ms: dict[str, float]) -> dict:
    """One offered load, ``m`` x capacity: the same schedule simulated and sent to the stack, compared."""
    model, eff = fitted
    slo_s = {t: v / 1000 for t, v in slo_ms.items()}
    specs = bench.build_workload(dataclasses.replace(
        cfg, num_requests=max(8, round(m * capacity * args.duration_s)), rate=m * capacity,
        seed=args.seed + int(m * 100)))
    tiers = bench.assign_tiers(specs, args.premium_share, args.seed)
    input_lens = [len(tokenizer.encode(s.prompt)) for s in specs]
    sim = sim_report(simulate(args.calibration_dir / CLUSTER_FILE, model, eff, specs, input_lens,
                              admission=admission(slo_ms), tiers=[tiers[s.index] for s in specs],
                              max_num_seqs=args.max_num_seqs,
                              local_prefill_batch_tokens=ENGINE_DEFAULTS.max_num_batched_tokens,
                              max_waiting_per_worker=args.max_waiting), slo_s)
    results = asyncio.run(bench.run_openai(stack.base_url, args.model, specs, progress=not args.no_progress,
                                           key_of=lambda s: bench.KEYS[tiers[s.index]]))
    live = bench.tier_report(results, tiers, slo_s)
    rows = compare(sim, live)
    print(f"{m:g}x: " + "; ".join(f"{k} sim {r['sim']:.2f} live {r['live']:.2f}"
                                  + (f" ({r['rel_error']:+.0%})" if r["rel_error"] is not None else "")
                                  for k, r in rows.items()))
    return {"sim": sim, "live": live, "comparison": rows}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from shared.tokenizer import load_tokenizer

    slo_ms = {"premium": args.premium_slo_ms, "batch": args.batch_slo_ms}
    cfg = bench.WorkloadConfig(prompt_words=args.prompt_words, output_tokens=args.output_tokens, spread=0.3,
                               seed=args.seed)
    fitted = fitted_model(args.calibration_dir)
    tokenizer = load_tokenizer(args.model)
    report: dict = {"config": {**vars(args), "out": str(args.out), "calibration_dir": str(args.calibration_dir)},
                    "slo_ms": slo_ms, "loads": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, open(args.out / "overload_calibration_stack.log", "w") as log:
        stack = bench.start_stack(Path(tmp), "on", args, slo_ms, log)
        try:
            stack.wait_ready(timeout_s=300)
            capacity = bench.measure_capacity(stack, args, cfg)
            print(f"measured capacity: {capacity:.2f} req/s")
            for m in (float(x) for x in args.loads.split(",")):
                report["loads"][f"{m:g}x"] = run_load(stack, args, cfg, m, capacity, fitted, tokenizer, slo_ms)
        finally:
            stack.stop()
    report["capacity_rps"] = capacity
    (args.out / "calibration_overload.json").write_text(json.dumps(report, indent=2, default=float))
    print("wrote", args.out / "calibration_overload.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
