"""The service path's cost: the whole stack with one decode worker vs the in-process engine, same
workload (same arrival schedule, prompts and lengths), in one run.

    python -m loadtest.bench.overhead [--num-requests 40 --rate 1 --repeats 2] [--out loadtest/results]

Both sides are started and warmed up first, then measured alternately ``--repeats`` times (the
other side idles meanwhile); the best repeat of each side is kept, which damps interference from
other work on the machine. Targets (issue 3): stack throughput >= 90% of in-process, added TTFT
p50 <= 10 ms. Writes ``overhead.json`` / ``overhead.png`` and the stack's logs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import tempfile
from pathlib import Path

from loadtest.tools.openai_load import add_workload_args, workload_config
from loadtest.tools.report import format_summary, write_report
from loadtest.tools.runner import run_in_process, run_openai
from loadtest.tools.stats import summarize
from loadtest.tools.workload import build_workload


def compare(stack_s: dict, engine_s: dict) -> dict:
    ratio = stack_s["output_token_throughput"] / engine_s["output_token_throughput"]
    added_ttft = (stack_s["ttft_s"]["p50"] - engine_s["ttft_s"]["p50"]) * 1000
    return {"throughput_ratio": ratio, "added_ttft_p50_ms": added_ttft,
            "added_itl_p50_ms": (stack_s["itl_s"]["p50"] - engine_s["itl_s"]["p50"]) * 1000,
            "targets": {"throughput_ratio_min": 0.9, "added_ttft_p50_ms_max": 10.0},
            "meets_targets": ratio >= 0.9 and added_ttft <= 10.0}


def main(argv: list[str] | None = None) -> int:
    from shared.engine import AsyncEngine, EngineConfig, parse_size  # noqa: PLC0415 — torch
    from shared.stack.stack import Stack, StackSpec  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-memory", default=None, help="both sides, e.g. 512MiB (default 1GiB on CPU)")
    p.add_argument("--repeats", type=int, default=2)
    add_workload_args(p)
    p.set_defaults(num_requests=40, rate=1.0)
    args = p.parse_args(argv)
    cfg = workload_config(args)
    specs = build_workload(cfg)
    warmup = build_workload(dataclasses.replace(cfg, num_requests=4, rate=50.0, seed=cfg.seed + 1))
    args.out.mkdir(parents=True, exist_ok=True)
    slo = {"slo_ttft_s": args.slo_ttft_ms / 1000, "slo_tpot_s": args.slo_tpot_ms / 1000}
    progress = not args.no_progress

    with open(args.out / "overhead_stack.log", "w") as log, tempfile.TemporaryDirectory() as state:
        stack = Stack(StackSpec(state_dir=Path(state), num_decode=1, model=args.model, port=0,
                                namespace=f"overhead{os.getpid()}",
                                decode_flags={"device": "cpu", "kv_cache_memory": args.kv_cache_memory}),
                      on_line=lambda name, line: log.write(f"{name:<12}| {line}\n"))
        engine = None
        try:
            stack.start()
            engine = AsyncEngine.start(EngineConfig(
                model=args.model, device="cpu",
                kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None))
            stack.wait_ready(timeout_s=300)
            asyncio.run(run_openai(stack.base_url, args.model, warmup, progress=False))
            asyncio.run(run_in_process(engine, warmup, progress=False))
            runs: dict[str, list] = {"stack": [], "engine": []}
            for _ in range(args.repeats):
                load = os.getloadavg()[0]
                results = asyncio.run(run_openai(stack.base_url, args.model, specs, progress=progress))
                runs["stack"].append((summarize(results, **slo), results, load))
                load = os.getloadavg()[0]
                results = asyncio.run(run_in_process(engine, specs, progress=progress))
                runs["engine"].append((summarize(results, **slo), results, load))
        finally:
            stack.stop()
            if engine is not None:
                engine.shutdown()

    best = {side: max(rs, key=lambda r: r[0]["output_token_throughput"]) for side, rs in runs.items()}
    comparison = compare(best["stack"][0], best["engine"][0])
    comparison.update(cpu_count=os.cpu_count(), repeats=args.repeats,
                      load_average_1m_before={side: [r[2] for r in rs] for side, rs in runs.items()},
                      all_repeats=[compare(s[0], e[0]) for s, e in zip(runs["stack"], runs["engine"])])
    print(format_summary("stack     ", best["stack"][0]))
    print(format_summary("in-process", best["engine"][0]))
    print(f"throughput ratio {comparison['throughput_ratio']:.3f}, added TTFT p50 "
          f"{comparison['added_ttft_p50_ms']:.1f} ms, added ITL p50 {comparison['added_itl_p50_ms']:.1f} ms"
          f" -> {'meets' if comparison['meets_targets'] else 'misses'} the targets")
    paths = write_report(args.out, "overhead", {"workload": dataclasses.asdict(cfg), "model": args.model,
                                                "kv_cache_memory": args.kv_cache_memory},
                         {"stack (1 decode worker)": best["stack"][:2],
                          "in-process engine": best["engine"][:2]},
                         extra={"comparison": comparison})
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
