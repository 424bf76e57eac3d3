"""Goodput and per-tier SLO attainment under overload, admission control on vs off, in one run.

    python -m loadtest.bench.overload [--loads 0.5,1,2,3 --duration-s 40 --premium-share 0.3]

One decode worker, two QoS tiers (premium: priority 0, tight TTFT SLO; batch: priority 2, loose
SLO), each client with its tier's API key. First the stack's capacity is measured (a saturating
burst: completed requests per second). Then, for each load (a multiple of that capacity), the same
Poisson arrival schedule runs against two stacks that differ only in admission control:

* ``control on``: the tiers' TTFT SLOs are in the QoS file, so admission predicts each request's
  TTFT and rejects (429 + Retry-After) what would miss, lowest priority first;
* ``control off``: the same tiers and priorities without SLOs: everything is admitted (until the
  worker's queue limit), so the engine still schedules by priority but nothing is shed.

Goodput = requests that completed within their tier's TTFT SLO, per second of the run. SLO
attainment per tier = the share of that tier's requests that did (a rejection counts as a miss;
the share among admitted requests is reported too). Writes ``overload.json`` and ``overload.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

from loadtest.tools.runner import run_openai
from loadtest.tools.stats import RequestResult
from loadtest.tools.workload import RequestSpec, WorkloadConfig, build_workload
from shared.telemetry.measure import meets_slo, percentile
from shared.telemetry.plot import figure

TIERS = ("premium", "batch")
KEYS = {"premium": "key-premium", "batch": "key-batch"}


def qos_yaml(slo_ms: dict[str, float] | None, itl_slo_ms: dict[str, float] | None = None) -> str:
    """The tiers file; ``slo_ms`` None: the same tiers without SLOs (no early rejection)."""
    lines = ["default_tier: batch", "tiers:"]
    for tier, priority in zip(TIERS, (0, 2)):
        slo = f", ttft_slo_ms: {slo_ms[tier]:g}" if slo_ms else ""
        if slo_ms and itl_slo_ms and itl_slo_ms.get(tier):
            slo += f", itl_slo_ms: {itl_slo_ms[tier]:g}"
        lines.append(f"  {tier}: {{priority: {priority}{slo}}}")
    return "\n".join(lines) + "\n"


def assign_tiers(specs: list[RequestSpec], premium_share: float, seed: int) -> dict[int, str]:
    rng = random.Random(seed)
    return {s.index: "premium" if rng.random() < premium_share else "batch" for s in specs}


def tier_report(results: list[RequestResult], tiers: dict[int, str], slo_s: dict[str, float]) -> dict:
    """Per tier and overall: sent, ok, rejected (429), 5xx, other errors, SLO attainment, TTFT p50/p90."""
    duration = max((r.finished_s or r.started_s for r in results), default=1.0) - \
        min((r.started_s for r in results), default=0.0)
    out = {}
    for tier in TIERS:
        rs = [r for r in results if tiers[r.index] == tier]
        ok = [r for r in rs if r.error is None and r.finished_s is not None]
        good = [r for r in ok if meets_slo(r.ttft_s, None, slo_s[tier])]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        # how admission's prediction compared with what happened: actual / predicted TTFT
        errors = [r.ttft_s / r.predicted_ttft_s for r in ok if r.ttft_s is not None and r.predicted_ttft_s]
        itls = [(r.finished_s - r.first_token_s) / (r.num_output_tokens - 1) for r in ok
                if r.first_token_s is not None and r.num_output_tokens > 1]
        out[tier] = {
            "num_sent": len(rs), "num_ok": len(ok), "num_good": len(good),
            "num_429": sum(1 for r in rs if r.error == "HTTP 429"),
            "num_5xx": sum(1 for r in rs if (r.error or "").startswith("HTTP 5")),
            "num_other_errors": sum(1 for r in rs if r.error and not r.error.startswith("HTTP ")),
            "slo_attainment": len(good) / len(rs) if rs else None,
            "slo_attainment_admitted": len(good) / len(ok) if ok else None,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "itl_p50_s": percentile(itls, 50), "itl_p90_s": percentile(itls, 90),
            "ttft_over_predicted_p50": percentile(errors, 50), "ttft_over_predicted_p90": percentile(errors, 90)}
    out["goodput_rps"] = sum(out[t]["num_good"] for t in TIERS) / max(duration, 1e-9)
    # each request, for the calibration: when it was sent, its tier, admission's prediction, its TTFT
    out["per_request"] = [{"tier": tiers[r.index], "sent_s": round(r.started_s, 3),
                           "predicted_ttft_s": r.predicted_ttft_s,
                           "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 3), "error": r.error}
                          for r in sorted(results, key=lambda r: r.started_s)]
    return out


def start_stack(state: Path, label: str, args, slo_ms: dict[str, float] | None, log):
    from services.stack.stack import Stack, StackSpec  # noqa: PLC0415

    qos = state / f"qos-{label}.yaml"
    qos.write_text(qos_yaml(slo_ms, {"premium": args.premium_itl_slo_ms} if slo_ms else None))
    keys = ",".join(f"{key}:{tier}" for tier, key in KEYS.items())
    stack = Stack(StackSpec(state_dir=state / label, model=args.model, port=0, namespace=f"ovl{label}{os.getpid()}",
                            decode_flags={"device": "cpu", "kv_cache_memory": args.kv_cache_memory,
                                          "max_num_seqs": args.max_num_seqs},
                            gateway_flags={"qos": str(qos), "api_keys": keys},
                            admission_flags={"qos": str(qos), "max_waiting_per_worker": args.max_waiting}),
                  on_line=lambda name, line: log.write(f"{label:<4}{name:<12}| {line}\n"))
    stack.start()
    return stack


def measure_capacity(stack, args, cfg: WorkloadConfig) -> float:
    """Completed requests per second of a burst that keeps the worker saturated: the median of
    ``args.capacity_bursts`` bursts (one burst alone varied by 1.4x between runs)."""
    rates = []
    for k in range(args.capacity_bursts):
        burst = build_workload(dataclasses.replace(cfg, num_requests=args.capacity_requests, rate=1000.0,
                                                   seed=cfg.seed + 7 + k))
        results = asyncio.run(run_openai(stack.base_url, args.model, burst, progress=not args.no_progress,
                                         key_of=lambda s: KEYS["batch"]))
        ok = [r for r in results if r.error is None and r.finished_s is not None]
        rates.append(len(ok) / (max(r.finished_s for r in ok) - min(r.started_s for r in ok)))
    print("capacity bursts: " + ", ".join(f"{r:.2f}" for r in rates) + " req/s")
    return statistics.median(rates)


def plot(path: Path, loads: list[float], report: dict) -> None:
    with figure(path, 1, 3, figsize=(15, 4)) as (fig, axes):
        for side in ("control on", "control off"):
            runs = [report[side][f"{m:g}x"] for m in loads]
            axes[0].plot(loads, [r["goodput_rps"] for r in runs], marker="o", label=side)
            for ax, tier in zip(axes[1:], TIERS):
                ax.plot(loads, [100 * (r[tier]["slo_attainment"] or 0) for r in runs], marker="o", label=side)
        for ax, title in zip(axes, ("goodput (req/s within SLO)", "premium SLO attainment (%)",
                                    "batch SLO attainment (%)")):
            ax.set_title(title)
            ax.set_xlabel("offered load (x measured capacity)")
            ax.grid(alpha=0.3)
            ax.legend()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--loads", default="0.5,1,2,3", help="offered loads, multiples of the measured capacity")
    p.add_argument("--duration-s", type=float, default=40.0, help="arrival span of each run")
    p.add_argument("--premium-share", type=float, default=0.3)
    p.add_argument("--premium-slo-ms", type=float, default=2000.0)
    p.add_argument("--batch-slo-ms", type=float, default=8000.0)
    p.add_argument("--premium-itl-slo-ms", type=float, default=None,
                   help="premium's ITL budget: admission sheds batch before a worker's ITL passes it")
    p.add_argument("--prompt-words", type=int, default=120)
    p.add_argument("--output-tokens", type=int, default=24)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-waiting", type=int, default=256, help="admission's per-worker queue limit")
    p.add_argument("--capacity-requests", type=int, default=48)
    p.add_argument("--capacity-bursts", type=int, default=3, help="capacity = the median of this many bursts")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("loadtest/results/overload"))
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _run_line(m: float, side: str, r: dict) -> str:
    return f"{m:g}x {side:<12} goodput {r['goodput_rps']:.2f} req/s | " + " | ".join(
        f"{t}: {r[t]['num_ok']}/{r[t]['num_sent']} ok, {r[t]['num_429']} x429, "
        f"{r[t]['num_5xx']} x5xx, SLO {100 * (r[t]['slo_attainment'] or 0):.0f}%"
        + (f", TTFT/predicted p50 {r[t]['ttft_over_predicted_p50']:.2f}"
           if r[t]["ttft_over_predicted_p50"] is not None else "") for t in TIERS)


def run_load(stacks: dict, args, cfg: WorkloadConfig, m: float, capacity: float, slo_s: dict[str, float],
             report: dict) -> None:
    """One offered load, ``m`` x capacity: the same schedule and tiers on each stack, one after the other."""
    rate = m * capacity
    specs = build_workload(dataclasses.replace(cfg, num_requests=max(8, round(rate * args.duration_s)),
                                               rate=rate, seed=args.seed + int(m * 100)))
    tiers = assign_tiers(specs, args.premium_share, args.seed)
    for side, stack in stacks.items():  # same schedule, one stack after the other
        results = asyncio.run(run_openai(stack.base_url, args.model, specs, progress=not args.no_progress,
                                         key_of=lambda s: KEYS[tiers[s.index]]))
        report[side][f"{m:g}x"] = tier_report(results, tiers, slo_s)
        print(_run_line(m, side, report[side][f"{m:g}x"]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loads = [float(x) for x in args.loads.split(",")]
    slo_ms = {"premium": args.premium_slo_ms, "batch": args.batch_slo_ms}
    slo_s = {t: v / 1000 for t, v in slo_ms.items()}
    cfg = WorkloadConfig(prompt_words=args.prompt_words, output_tokens=args.output_tokens, spread=0.3, seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"control on": {}, "control off": {}}
    with tempfile.TemporaryDirectory() as tmp, open(args.out / "overload_stacks.log", "w") as log:
        stacks = {"control on": start_stack(Path(tmp), "on", args, slo_ms, log),
                  "control off": start_stack(Path(tmp), "off", args, None, log)}
        try:
            for stack in stacks.values():
                stack.wait_ready(timeout_s=300)
            capacity = measure_capacity(stacks["control off"], args, cfg)
            print(f"measured capacity: {capacity:.2f} req/s")
            for m in loads:
                run_load(stacks, args, cfg, m, capacity, slo_s, report)
        finally:
            for stack in stacks.values():
                stack.stop()
    ratios = {f"{m:g}x": (report["control on"][f"{m:g}x"]["goodput_rps"] /
                          max(report["control off"][f"{m:g}x"]["goodput_rps"], 1e-9)) for m in loads}
    print("goodput, control on / off: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    payload = {"config": {**vars(args), "out": str(args.out)}, "capacity_rps": capacity, "slo_ms": slo_ms,
               "goodput_ratio_on_vs_off": ratios, "cpu_count": os.cpu_count(),
               "load_average_1m_at_end": os.getloadavg()[0], **report}
    (args.out / "overload.json").write_text(json.dumps(payload, indent=2))
    plot(args.out / "overload.png", loads, report)
    print("wrote", args.out / "overload.json", args.out / "overload.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
