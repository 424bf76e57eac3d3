"""A burst right after start-up: is the shed order kept before the worker has served anything?

    python -m loadtest.bench.startup [--batch-requests 48 --premium-requests 8 --slo-ms 4000]

For each side (warm-up's prefill rate off, then on: the decode worker's ``--no-warmup-prefill-rate``
/ ``--warmup-prefill-rate``) a fresh stack starts (one decode worker, QoS tiers ``premium``
priority 0 and ``batch`` priority 2, both with a ``--slo-ms`` TTFT SLO; tier by API key). As soon
as it is ready, ``--batch-requests`` long batch prompts (``--batch-words`` words each) arrive at
once, then after ``--premium-after-s`` ``--premium-requests`` short premium ones. Every request is
a streamed ``/v1/completions`` with ``ignore_eos``. Reported per side and tier: rejected (429, with
or without Retry-After), TTFT p50/p90 of the admitted, SLO attainment (a rejection counts as a
miss), and how admission's predicted TTFT compared with the measured one; then on/off ratios.

Without a rate, admission admits every request of the burst (nothing to predict from). Writes
``startup.json`` and ``startup.png`` (TTFT of every admitted request by tier, both sides) under
``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from loadtest.tools.harness import ratio
from loadtest.tools.runner import run_openai
from loadtest.tools.stats import RequestResult
from loadtest.tools.workload import RequestSpec
from shared.telemetry.measure import percentile
from shared.telemetry.plot import figure

QOS = """default_tier: batch
tiers:
  premium: {{priority: 0, ttft_slo_ms: {slo}}}
  batch:   {{priority: 2, ttft_slo_ms: {slo}}}
"""
KEYS = {"premium": "kp", "batch": "kb"}


def burst(args) -> tuple[list[RequestSpec], dict[int, str]]:
    specs, tier = [], {}
    for i in range(args.batch_requests):
        specs.append(RequestSpec(i, 0.0, f"Report {i}. " + "word " * args.batch_words, args.output_tokens))
        tier[i] = "batch"
    for j in range(args.premium_requests):
        i = args.batch_requests + j
        specs.append(RequestSpec(i, args.premium_after_s, f"Premium question {j}: " + "colour " * args.premium_words,
                                 args.output_tokens))
        tier[i] = "premium"
    return specs, tier


def summarize(results: list[RequestResult], tier_of: dict[int, str], slo_s: float) -> dict:
    out = {}
    for tier in ("premium", "batch"):
        mine = [r for r in results if tier_of[r.index] == tier]
        admitted = [r for r in mine if r.error is None and r.ttft_s is not None]
        rejected = [r for r in mine if r.error == "HTTP 429"]
        ttfts = [r.ttft_s for r in admitted]
        ratios = [r.predicted_ttft_s / r.ttft_s for r in admitted if r.predicted_ttft_s and r.ttft_s]
        out[tier] = {
            "requests": len(mine), "admitted": len(admitted), "rejected": len(rejected),
            "rejected_with_retry_after": sum(r.retry_after_s is not None for r in rejected),
            "failed": len(mine) - len(admitted) - len(rejected),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "attainment": sum(t <= slo_s for t in ttfts) / len(mine) if mine else None,
            "predicted_over_measured_p50": percentile(ratios, 50),
            "ttfts_s": ttfts,
        }
    return out


def run_side(args, measure_rate: bool, state: Path, log) -> dict:
    from services.stack.stack import Stack, StackSpec  # noqa: PLC0415

    state.mkdir(parents=True, exist_ok=True)
    (state / "qos.yaml").write_text(QOS.format(slo=args.slo_ms))
    stack = Stack(StackSpec(
        state_dir=state, model=args.model, port=0, namespace=f"su{os.getpid()}{int(measure_rate)}",
        decode_flags={"device": "cpu", "kv_cache_memory": args.kv_cache_memory, "max_model_len": 2048,
                      "warmup_prefill_rate": measure_rate},
        gateway_flags={"qos": str(state / "qos.yaml"), "api_keys": ",".join(f"{k}:{t}" for t, k in KEYS.items())},
        admission_flags={"qos": str(state / "qos.yaml")}), on_line=lambda name, line: log.write(f"{name:<12}| {line}\n"))
    try:
        stack.start()
        stack.wait_ready(timeout_s=600)
        specs, tier_of = burst(args)
        started = time.time()
        results = asyncio.run(run_openai(stack.base_url, args.model, specs, progress=False,
                                         key_of=lambda s: KEYS[tier_of[s.index]]))
        side = summarize(results, tier_of, args.slo_ms / 1000)
        side["wall_s"] = time.time() - started
        return side
    finally:
        stack.stop()


def plot(sides: dict, path: Path) -> None:
    with figure(path, figsize=(7, 4), dpi=120) as (fig, ax):
        for x, (name, side) in enumerate(sides.items()):
            for dx, (tier, color) in enumerate((("premium", "tab:red"), ("batch", "tab:blue"))):
                ys = side[tier]["ttfts_s"]
                ax.scatter([x + 0.2 * dx - 0.1] * len(ys), ys, s=12, color=color, alpha=0.6,
                           label=tier if x == 0 else None)
        ax.set_xticks(range(len(sides)), [f"warm-up rate {n}" for n in sides])
        ax.set_ylabel("TTFT of admitted requests (s)")
        ax.legend()
        ax.set_title("A burst right after ready")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-requests", type=int, default=48)
    p.add_argument("--batch-words", type=int, default=1100, help="words per batch prompt (~1 token each)")
    p.add_argument("--premium-requests", type=int, default=8)
    p.add_argument("--premium-words", type=int, default=50)
    p.add_argument("--premium-after-s", type=float, default=1.0, help="premium requests arrive this long after the burst")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--slo-ms", type=float, default=4000.0, help="TTFT SLO of both tiers")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--sides", default="off,on", help="warm-up rate off and/or on, in this order")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/startup"))
    args = p.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    sides = {}
    with tempfile.TemporaryDirectory() as tmp, open(args.out / "startup.stack.log", "w") as log:
        for name in args.sides.split(","):
            sides[name] = run_side(args, name == "on", Path(tmp) / name, log)
            for tier in ("premium", "batch"):
                t = sides[name][tier]
                print(f"warm-up rate {name:<3} {tier:<8} admitted {t['admitted']:>3}/{t['requests']:<3} "
                      f"rejected {t['rejected']} ({t['rejected_with_retry_after']} with Retry-After), "
                      f"TTFT p50/p90 {t['ttft_p50_s'] or 0:.2f}/{t['ttft_p90_s'] or 0:.2f} s, "
                      f"attainment {t['attainment']:.0%}, predicted/measured p50 {t['predicted_over_measured_p50']}",
                      flush=True)
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "sides": sides}
    if "on" in sides and "off" in sides:
        report["on_vs_off"] = {f"{tier}_{key}": ratio(sides["on"][tier][key], sides["off"][tier][key])
                               for tier in ("premium", "batch") for key in ("ttft_p50_s", "ttft_p90_s", "attainment")}
        print("on/off:", ", ".join(f"{k} {v:.2f}x" for k, v in report["on_vs_off"].items() if v is not None))
    (args.out / "startup.json").write_text(json.dumps(report, indent=1))
    plot(sides, args.out / "startup.png")
    print(f"wrote {args.out / 'startup.json'} and startup.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
