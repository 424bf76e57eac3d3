"""Open-loop load against any OpenAI-compatible endpoint (streaming ``/v1/completions``).

    python -m loadtest.tools.openai_load --base-url http://127.0.0.1:8000 --rate 4 --num-requests 100 \\
        [--burstiness 0.5] [--shared-prefix-words 200] [--slo-ttft-ms 500] --out loadtest/results

Prints a summary and writes ``<name>.json`` (config, summary, every request's timings) and
``<name>.png`` (TTFT / ITL / end-to-end CDFs).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path

from loadtest.tools.report import format_summary, write_report
from loadtest.tools.runner import run_openai
from loadtest.tools.stats import summarize
from loadtest.tools.workload import RequestSpec, WorkloadConfig, build_workload


def add_workload_args(p: argparse.ArgumentParser) -> None:
    d = WorkloadConfig()
    p.add_argument("--num-requests", type=int, default=d.num_requests)
    p.add_argument("--rate", type=float, default=d.rate, help="mean arrivals per second")
    p.add_argument("--burstiness", type=float, default=d.burstiness, help="gamma shape (1: Poisson)")
    p.add_argument("--prompt-words", type=int, default=d.prompt_words)
    p.add_argument("--output-tokens", type=int, default=d.output_tokens)
    p.add_argument("--spread", type=float, default=d.spread, help="length spread around the mean")
    p.add_argument("--shared-prefix-words", type=int, default=d.shared_prefix_words)
    p.add_argument("--num-prefixes", type=int, default=d.num_prefixes)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--out", type=Path, default=Path("loadtest/results"))
    p.add_argument("--no-progress", action="store_true")


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(num_requests=args.num_requests, rate=args.rate, burstiness=args.burstiness,
                          prompt_words=args.prompt_words, output_tokens=args.output_tokens,
                          spread=args.spread, shared_prefix_words=args.shared_prefix_words,
                          num_prefixes=args.num_prefixes, seed=args.seed)


def slo_args(args: argparse.Namespace) -> dict[str, float]:
    """``summarize``'s SLO keywords from ``--slo-ttft-ms`` and ``--slo-tpot-ms``."""
    return {"slo_ttft_s": args.slo_ttft_ms / 1000, "slo_tpot_s": args.slo_tpot_ms / 1000}


def comparison_workload(args: argparse.Namespace, num_warmup: int = 4
                        ) -> tuple[WorkloadConfig, list[RequestSpec], list[RequestSpec], dict[str, float]]:
    """An on/off comparison's load from ``add_workload_args``' options: the config, its requests, a
    warm-up (``num_warmup`` requests at 50/s, the next seed) and ``summarize``'s SLO keywords; makes
    ``--out``."""
    cfg = workload_config(args)
    warmup = build_workload(dataclasses.replace(cfg, num_requests=num_warmup, rate=50.0, seed=cfg.seed + 1))
    args.out.mkdir(parents=True, exist_ok=True)
    return cfg, build_workload(cfg), warmup, slo_args(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--api-key", default=None)
    p.add_argument("--name", default="openai_load")
    add_workload_args(p)
    args = p.parse_args(argv)
    cfg = workload_config(args)
    results = asyncio.run(run_openai(args.base_url, args.model, build_workload(cfg), api_key=args.api_key,
                                     progress=not args.no_progress))
    summary = summarize(results, **slo_args(args))
    print(format_summary(args.base_url, summary))
    paths = write_report(args.out, args.name, {"workload": dataclasses.asdict(cfg), "base_url": args.base_url,
                                               "model": args.model}, {args.base_url: (summary, results)})
    print("wrote", *paths)
    return 0 if summary["num_errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
