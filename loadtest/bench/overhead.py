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
import dataclasses
import os
import tempfile
from pathlib import Path

from loadtest.tools.harness import alternate, engine_side, log_to, report_comparison, stack_side, warm_up
from loadtest.tools.openai_load import add_workload_args, comparison_workload


def compare(stack_s: dict, engine_s: dict) -> dict:
    ratio = stack_s["output_token_throughput"] / engine_s["output_token_throughput"]
    added_ttft = (stack_s["ttft_s"]["p50"] - engine_s["ttft_s"]["p50"]) * 1000
    return {"throughput_ratio": ratio, "added_ttft_p50_ms": added_ttft,
            "added_itl_p50_ms": (stack_s["itl_s"]["p50"] - engine_s["itl_s"]["p50"]) * 1000,
            "targets": {"throughput_ratio_min": 0.9, "added_ttft_p50_ms_max": 10.0},
            "meets_targets": ratio >= 0.9 and added_ttft <= 10.0}


def main(argv: list[str] | None = None) -> int:
    from services.stack.stack import Stack, StackSpec  # noqa: PLC0415
    from shared.engine import AsyncEngine, EngineConfig, parse_size  # noqa: PLC0415 — torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-memory", default=None, help="both sides, e.g. 512MiB (default 1GiB on CPU)")
    p.add_argument("--repeats", type=int, default=2)
    add_workload_args(p)
    p.set_defaults(num_requests=40, rate=1.0)
    args = p.parse_args(argv)
    cfg, specs, warmup, slo = comparison_workload(args)
    progress = not args.no_progress

    with open(args.out / "overhead_stack.log", "w") as log, tempfile.TemporaryDirectory() as state:
        stack = Stack(StackSpec(state_dir=Path(state), num_decode=1, model=args.model, port=0,
                                namespace=f"overhead{os.getpid()}",
                                decode_flags={"device": "cpu", "kv_cache_memory": args.kv_cache_memory}),
                      on_line=log_to(log))
        engine = None
        try:
            stack.start()
            engine = AsyncEngine.start(EngineConfig(
                model=args.model, device="cpu",
                kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None))
            sides = {"stack": stack_side(stack, args.model), "engine": engine_side(engine)}
            warm_up(sides, warmup)
            runs = alternate(sides, specs, args.repeats, slo, progress)
        finally:
            stack.stop()
            if engine is not None:
                engine.shutdown()

    report_comparison(args.out, "overhead", {"workload": dataclasses.asdict(cfg), "model": args.model,
                                             "kv_cache_memory": args.kv_cache_memory}, runs, compare,
                      {"stack": ("stack     ", "stack (1 decode worker)"),
                       "engine": ("in-process", "in-process engine")},
                      detail=lambda result: f", added ITL p50 {result['added_itl_p50_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
