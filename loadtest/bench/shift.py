"""SLO attainment when the workload shifts, the autoscaler on vs fixed splits, in one run.

    python -m loadtest.bench.shift [--phase-s 60 --chat-rate 1.5 --docs-rate 0.6]

Two workers serve three phases of open-loop (Poisson) traffic: ``chat`` (short prompts, long
outputs: decode-heavy), ``docs`` (long prompts, short outputs: prefill-heavy) and ``chat`` again.
The same schedule runs against three stacks, one after the other (never two at once: they would
share the CPU):

* ``fixed 2D``: two decode workers, each prefilling its own prompts;
* ``fixed 1P+1D``: one prefill and one decode worker (static disaggregation);
* ``autoscale``: two decode workers and the autoscaler acting (``--autoscale``, minimum 0 prefill
  and 1 decode workers), free to flip a worker to prefill and back while serving.

The autoscaler's decode capacity per worker (``--decode-capacity``; 0: measured here, first, as
the output tokens per second per worker of a saturating chat burst on the fixed 2D stack) is the
one figure it cannot measure while serving. A request meets its SLO when its time to first token
is within ``--ttft-slo-ms`` and its mean inter-token latency within ``--itl-slo-ms``; attainment
is per phase, failures count as misses. The autoscaler's decisions and each stack's split over
time (sampled from ``/status`` every second) go into ``<name>.json``; ``<name>.png`` plots both.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import tempfile
from pathlib import Path

from loadtest.tools.harness import SplitSampler, status
from loadtest.tools.runner import run_openai
from loadtest.tools.stats import RequestResult
from loadtest.tools.workload import RequestSpec, WorkloadConfig, build_workload
from shared.telemetry import measure
from shared.telemetry.measure import percentile
from shared.telemetry.plot import figure

PHASES = ("chat", "docs", "chat again")
SETUPS = ("fixed 2D", "fixed 1P+1D", "autoscale")


def schedule(args) -> tuple[list[RequestSpec], dict[int, str]]:
    """Every phase's arrivals back to back, one list; request index → its phase."""
    chat = WorkloadConfig(prompt_words=args.chat_prompt_words, output_tokens=args.chat_output_tokens, spread=0.3)
    docs = WorkloadConfig(prompt_words=args.docs_prompt_words, output_tokens=args.docs_output_tokens, spread=0.3)
    specs: list[RequestSpec] = []
    phase_of: dict[int, str] = {}
    for k, (name, cfg, rate) in enumerate(zip(PHASES, (chat, docs, chat),
                                              (args.chat_rate, args.docs_rate, args.chat_rate))):
        part = build_workload(dataclasses.replace(cfg, rate=rate, num_requests=max(4, round(rate * args.phase_s)),
                                                  seed=args.seed + k))
        for s in part:
            index = len(specs)
            specs.append(RequestSpec(index, k * args.phase_s + s.at_s, s.prompt, s.max_tokens))
            phase_of[index] = name
    return specs, phase_of


def meets_slo(r: RequestResult, ttft_slo_s: float, itl_slo_s: float) -> bool:
    """Served and good by ``shared.telemetry.measure.meets_slo``, the mean ITL as its TPOT."""
    return r.error is None and r.finished_s is not None and measure.meets_slo(r.ttft_s, mean_itl_s(r),
                                                                             ttft_slo_s, itl_slo_s)


def mean_itl_s(r: RequestResult) -> float:
    if r.first_token_s is None or r.finished_s is None or r.num_output_tokens < 2:
        return 0.0
    return (r.finished_s - r.first_token_s) / (r.num_output_tokens - 1)


def phase_report(results: list[RequestResult], phase_of: dict[int, str], ttft_slo_s: float,
                 itl_slo_s: float) -> dict:
    """Per phase: sent, ok, errors, SLO attainment, TTFT and ITL p50/p90."""
    out = {}
    for phase in dict.fromkeys(phase_of.values()):
        rs = [r for r in results if phase_of[r.index] == phase]
        ok = [r for r in rs if r.error is None and r.finished_s is not None]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        itls = [mean_itl_s(r) for r in ok if r.num_output_tokens > 1]
        out[phase] = {"num_sent": len(rs), "num_ok": len(ok),
                      "num_errors": sum(1 for r in rs if r.error is not None),
                      "slo_attainment": sum(meets_slo(r, ttft_slo_s, itl_slo_s) for r in rs) / len(rs) if rs else None,
                      "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
                      "itl_p50_s": percentile(itls, 50), "itl_p90_s": percentile(itls, 90)}
    out["all"] = {"num_sent": len(results),
                  "slo_attainment": sum(meets_slo(r, ttft_slo_s, itl_slo_s) for r in results) / max(1, len(results))}
    return out


def start_stack(state: Path, label: str, args, num_decode: int, num_prefill: int, autoscale: dict | None, log):
    from services.stack.stack import Stack, StackSpec  # noqa: PLC0415

    engine = {"device": "cpu", "kv_cache_memory": args.kv_cache_memory, "max_model_len": args.max_model_len,
              "max_num_seqs": args.max_num_seqs}
    tag = label.replace(" ", "").replace("+", "").lower()
    stack = Stack(StackSpec(state_dir=state / tag, model=args.model, port=0, namespace=f"shift{tag}{os.getpid()}",
                            num_decode=num_decode, num_prefill=num_prefill, registry_ttl_s=3.0,
                            decode_flags={**engine, "drain_timeout_s": 120}, prefill_flags=engine,
                            autoscaler_flags=autoscale or {}),
                  on_line=lambda name, line: log.write(f"{tag:<10}{name:<12}| {line}\n"))
    stack.start()
    stack.wait_ready(timeout_s=300)
    return stack


def measure_decode_capacity(base_url: str, args) -> float:
    """Output tokens per second per worker of a saturating burst of chat requests (2 workers)."""
    cfg = WorkloadConfig(num_requests=args.capacity_requests, rate=1000.0, prompt_words=args.chat_prompt_words,
                         output_tokens=args.chat_output_tokens, spread=0.3, seed=args.seed + 99)
    results = asyncio.run(run_openai(base_url, args.model, build_workload(cfg), progress=not args.no_progress))
    ok = [r for r in results if r.error is None and r.finished_s is not None]
    span = max(r.finished_s for r in ok) - min(r.started_s for r in ok)
    return sum(r.num_output_tokens for r in ok) / span / 2


def plot(path: Path, report: dict, phase_s: float) -> None:
    with figure(path, 1, 2, figsize=(14, 4.5)) as (fig, (bars, split)):
        width = 0.8 / len(SETUPS)
        for i, setup in enumerate(SETUPS):
            if setup not in report["setups"]:
                continue
            phases = report["setups"][setup]["phases"]
            values = [100 * (phases[p]["slo_attainment"] or 0) for p in PHASES]
            b = bars.bar([x + (i - 1) * width for x in range(len(PHASES))], values, width, label=setup)
            bars.bar_label(b, fmt="%.0f", fontsize=7)
            samples = report["setups"][setup]["split"]
            if samples:
                split.step([t for t, _, _ in samples], [p for _, p, _ in samples], where="post", label=setup)
        bars.set_xticks(range(len(PHASES)), PHASES)
        bars.set_ylim(0, 110)
        bars.set_title("SLO attainment per phase (%)")
        bars.legend(loc="lower right")
        for k in range(1, len(PHASES)):
            split.axvline(k * phase_s, color="gray", linestyle=":")
        split.set_title("ready prefill workers (phase boundaries dotted)")
        split.set_xlabel("seconds since the first arrival")
        split.legend()
        for ax in (bars, split):
            ax.grid(alpha=0.3)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--phase-s", type=float, default=60.0, help="arrival span of each phase")
    p.add_argument("--chat-rate", type=float, default=1.5, help="chat requests per second")
    p.add_argument("--chat-prompt-words", type=int, default=20)
    p.add_argument("--chat-output-tokens", type=int, default=64)
    p.add_argument("--docs-rate", type=float, default=0.6, help="docs requests per second")
    p.add_argument("--docs-prompt-words", type=int, default=600)
    p.add_argument("--docs-output-tokens", type=int, default=4)
    p.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    p.add_argument("--itl-slo-ms", type=float, default=150.0)
    p.add_argument("--decode-capacity", type=float, default=0.0,
                   help="the autoscaler's decode tokens/s per worker (0: measured on the fixed 2D stack)")
    p.add_argument("--capacity-requests", type=int, default=24)
    p.add_argument("--autoscale-interval-s", type=float, default=2.0)
    p.add_argument("--autoscale-window-s", type=float, default=10.0)
    p.add_argument("--autoscale-cooldown-s", type=float, default=10.0)
    p.add_argument("--autoscale-stabilization-s", type=float, default=0.0,
                   help="flip only once every tick of this long asked for it (default 0, as the recorded runs: "
                        "a phase here lasts a minute)")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated subset of: {', '.join(SETUPS)}")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("loadtest/results/shift"))
    p.add_argument("--name", default="shift", help="output file name stem (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if unknown := [s for s in setups if s not in SETUPS]:
        p.error(f"unknown setup(s) {unknown}; known: {', '.join(SETUPS)}")
    args.setups = setups
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs, phase_of = schedule(args)
    ttft_slo_s, itl_slo_s = args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000
    args.out.mkdir(parents=True, exist_ok=True)
    decode_capacity = args.decode_capacity
    report: dict = {"setups": {}}
    layouts = {"fixed 2D": (2, 0), "fixed 1P+1D": (1, 1), "autoscale": (2, 0)}
    with tempfile.TemporaryDirectory() as tmp, open(args.out / f"{args.name}_stacks.log", "w", buffering=1) as log:
        for setup in sorted(args.setups, key=SETUPS.index):
            autoscale = None
            if setup == "autoscale":
                if not decode_capacity:
                    raise SystemExit("the autoscale setup needs --decode-capacity or the fixed 2D setup before it")
                autoscale = {"autoscale": True, "autoscale_interval_s": args.autoscale_interval_s,
                             "autoscale_window_s": args.autoscale_window_s,
                             "autoscale_cooldown_s": args.autoscale_cooldown_s,
                             "autoscale_stabilization_s": args.autoscale_stabilization_s, "min_prefill_workers": 0,
                             "min_decode_workers": 1, "decode_capacity_tokens_per_s": decode_capacity}
            stack = start_stack(Path(tmp), setup, args, *layouts[setup], autoscale, log)
            try:
                if setup == "fixed 2D" and not decode_capacity:
                    decode_capacity = measure_decode_capacity(stack.base_url, args)
                    print(f"measured decode capacity: {decode_capacity:.1f} tokens/s per worker")
                with SplitSampler(stack.base_url) as sampler:
                    results = asyncio.run(run_openai(stack.base_url, args.model, specs, progress=not args.no_progress))
                scaling = status(stack.base_url).get("scaling") or {}
            finally:
                stack.stop()
            phases = phase_report(results, phase_of, ttft_slo_s, itl_slo_s)
            report["setups"][setup] = {"phases": phases, "split": sampler.samples,
                                       "decisions": scaling.get("recent", [])}
            print(f"{setup:<12} " + " | ".join(
                f"{p}: SLO {100 * (phases[p]['slo_attainment'] or 0):.0f}% ({phases[p]['num_ok']}/"
                f"{phases[p]['num_sent']} ok, TTFT p90 {phases[p]['ttft_p90_s'] or 0:.2f}s, "
                f"ITL p90 {1000 * (phases[p]['itl_p90_s'] or 0):.0f}ms)" for p in PHASES))
    report["config"] = {**vars(args), "out": str(args.out), "cpu_count": os.cpu_count(),
                        "decode_capacity_tokens_per_s": decode_capacity, "load_average_1m_at_end": os.getloadavg()[0]}
    if "autoscale" in report["setups"]:
        auto = report["setups"]["autoscale"]["phases"]["all"]["slo_attainment"]
        report["autoscale_vs_fixed"] = {s: auto / max(report["setups"][s]["phases"]["all"]["slo_attainment"], 1e-9)
                                        for s in report["setups"] if s != "autoscale"}
        print("overall SLO attainment, autoscale / fixed: " + ", ".join(
            f"{s} {r:.2f}x" for s, r in report["autoscale_vs_fixed"].items()))
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    plot(args.out / f"{args.name}.png", report, args.phase_s)
    print("wrote", args.out / f"{args.name}.json", args.out / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
