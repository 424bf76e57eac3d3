"""The service path's cost: the whole stack with one decode worker vs the in-process engine, same
workload (same arrival schedule, prompts and lengths), in one run.

    python -m loadtest.overhead [--num-requests 48 --rate 2] [--out loadtest/results]

Both sides are warmed up first. Targets (issue 3): stack throughput >= 90% of in-process, added
TTFT p50 <= 10 ms. Writes ``overhead.json`` / ``overhead.png`` and the stack's logs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import tempfile
from pathlib import Path

from loadtest.openai_load import add_workload_args, workload_config
from loadtest.report import format_summary, write_report
from loadtest.runner import run_in_process, run_openai
from loadtest.stats import summarize
from loadtest.workload import build_workload


def run_stack(args, specs, warmup, log_path: Path):
    from shared.runtime.stack import Stack, StackSpec  # noqa: PLC0415

    with open(log_path, "w") as log, tempfile.TemporaryDirectory() as state:
        stack = Stack(StackSpec(state_dir=Path(state), num_decode=1, model=args.model, port=0,
                                namespace=f"overhead{os.getpid()}",
                                decode_flags={"device": "cpu", "kv_cache_memory": args.kv_cache_memory}),
                      on_line=lambda name, line: log.write(f"{name:<12}| {line}\n"))
        try:
            stack.start()
            stack.wait_ready(timeout_s=300)
            asyncio.run(run_openai(stack.base_url, args.model, warmup, progress=False))
            return asyncio.run(run_openai(stack.base_url, args.model, specs, progress=not args.no_progress))
        finally:
            stack.stop()


def run_engine(args, specs, warmup):
    from shared.engine import AsyncEngine, EngineConfig, parse_size  # noqa: PLC0415

    engine = AsyncEngine.start(EngineConfig(
        model=args.model, device="cpu",
        kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None))
    try:
        asyncio.run(run_in_process(engine, warmup, progress=False))
        return asyncio.run(run_in_process(engine, specs, progress=not args.no_progress))
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-memory", default=None, help="both sides, e.g. 512MiB (default 1GiB on CPU)")
    add_workload_args(p)
    p.set_defaults(num_requests=48, rate=2.0)
    args = p.parse_args(argv)
    cfg = workload_config(args)
    specs = build_workload(cfg)
    warmup = build_workload(dataclasses.replace(cfg, num_requests=4, rate=50.0, seed=cfg.seed + 1))
    args.out.mkdir(parents=True, exist_ok=True)
    slo = {"slo_ttft_s": args.slo_ttft_ms / 1000, "slo_tpot_s": args.slo_tpot_ms / 1000}

    # Other work on the machine skews both sides: record the load average before each.
    load = {"stack": os.getloadavg()[0]}
    stack_results = run_stack(args, specs, warmup, args.out / "overhead_stack.log")
    load["in_process"] = os.getloadavg()[0]
    engine_results = run_engine(args, specs, warmup)
    stack_s, engine_s = summarize(stack_results, **slo), summarize(engine_results, **slo)
    comparison = {
        "throughput_ratio": stack_s["output_token_throughput"] / engine_s["output_token_throughput"],
        "added_ttft_p50_ms": (stack_s["ttft_s"]["p50"] - engine_s["ttft_s"]["p50"]) * 1000,
        "added_itl_p50_ms": (stack_s["itl_s"]["p50"] - engine_s["itl_s"]["p50"]) * 1000,
        "targets": {"throughput_ratio_min": 0.9, "added_ttft_p50_ms_max": 10.0},
        "load_average_1m_before": load, "cpu_count": os.cpu_count(),
    }
    comparison["meets_targets"] = (comparison["throughput_ratio"] >= 0.9
                                   and comparison["added_ttft_p50_ms"] <= 10.0)
    print(format_summary("stack     ", stack_s))
    print(format_summary("in-process", engine_s))
    print(f"throughput ratio {comparison['throughput_ratio']:.3f}, added TTFT p50 "
          f"{comparison['added_ttft_p50_ms']:.1f} ms, added ITL p50 {comparison['added_itl_p50_ms']:.1f} ms"
          f" -> {'meets' if comparison['meets_targets'] else 'misses'} the targets")
    paths = write_report(args.out, "overhead", {"workload": dataclasses.asdict(cfg), "model": args.model,
                                                "kv_cache_memory": args.kv_cache_memory},
                         {"stack (1 decode worker)": (stack_s, stack_results),
                          "in-process engine": (engine_s, engine_results)},
                         extra={"comparison": comparison})
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
