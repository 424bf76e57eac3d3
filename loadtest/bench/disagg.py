"""1 prefill + 1 decode worker (remote prefill over NIXL) vs 1 aggregated decode worker, same
long-prompt workload (same arrival schedule, prompts and lengths), in one run.

    python -m loadtest.bench.disagg [--num-requests 20 --rate 0.3 --prompt-words 700 --repeats 2]

Both stacks run side by side; they are warmed up, then measured alternately ``--repeats`` times
(the other idles meanwhile) and the best repeat of each is kept. The disaggregated stack sends every
prompt with a whole uncached block to its prefill worker (``--max-local-prefill-tokens 0``).

On one small CPU host the two workers of the disaggregated stack share the same cores the
aggregated worker has to itself (each gets half the threads), so this measures what the split
costs — queueing on JetStream, the KV write, the notification — rather than the interference it
removes on separate GPUs. Writes ``disagg.json`` / ``disagg.png`` and both stacks' logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path

from loadtest.tools.harness import alternate, best, comparison, log_to, stack_side, status, warm_up
from loadtest.tools.openai_load import add_workload_args, comparison_workload
from loadtest.tools.report import format_summary, write_report


def compare(disagg: dict, agg: dict) -> dict:
    def ratio(key: str, q: str | None = None) -> float | None:
        a, b = (disagg[key], agg[key]) if q is None else (disagg[key][q], agg[key][q])
        return None if not a or not b else a / b

    return {"throughput_ratio": ratio("output_token_throughput"), "ttft_p50_ratio": ratio("ttft_s", "p50"),
            "ttft_p90_ratio": ratio("ttft_s", "p90"), "itl_p50_ratio": ratio("itl_s", "p50"),
            "itl_p90_ratio": ratio("itl_s", "p90"), "e2e_p50_ratio": ratio("e2e_s", "p50")}


def decode_counters(stack) -> dict:
    view = status(stack.base_url)
    keys = ("num_remote_prefills", "num_local_prefills", "num_prefill_fallbacks", "kv_bytes_received")
    return {w["info"]["worker_id"]: {k: (w["load"] or {}).get(k) for k in keys}
            for w in view["workers"] if w["info"]["role"] == "decode"}


def main(argv: list[str] | None = None) -> int:
    from services.stack.stack import Stack, StackSpec  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-memory", default="512MiB", help="per worker")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-local-prefill-tokens", type=int, default=0, help="the disaggregated stack's threshold")
    add_workload_args(p)
    p.set_defaults(num_requests=20, rate=0.3, prompt_words=700, output_tokens=32, spread=0.3,
                   slo_ttft_ms=5000.0, slo_tpot_ms=300.0)
    args = p.parse_args(argv)
    cfg, specs, warmup, slo = comparison_workload(args, num_warmup=3)
    engine = {"device": "cpu", "kv_cache_memory": args.kv_cache_memory}
    sides = {
        "aggregated (1 decode)": dict(num_decode=1, num_prefill=0, decode_flags=engine),
        "disaggregated (1 prefill + 1 decode)": dict(
            num_decode=1, num_prefill=1, prefill_flags=engine,
            decode_flags={**engine, "max_local_prefill_tokens": args.max_local_prefill_tokens}),
    }
    stacks: dict[str, Stack] = {}
    counters = {}
    with tempfile.TemporaryDirectory() as state:
        logs = {label: open(args.out / f"disagg_{'agg' if i == 0 else 'pd'}_stack.log", "w")
                for i, label in enumerate(sides)}
        try:
            for i, (label, kw) in enumerate(sides.items()):
                stacks[label] = Stack(
                    StackSpec(state_dir=Path(state) / str(i), model=args.model, port=0,
                              namespace=f"bench{i}x{os.getpid()}", **kw),
                    on_line=log_to(logs[label]))
                stacks[label].start()
            targets = {label: stack_side(stack, args.model) for label, stack in stacks.items()}
            warm_up(targets, warmup)
            before = {label: decode_counters(s) for label, s in stacks.items()}
            runs = alternate(targets, specs, args.repeats, slo, progress=False)
            counters = {label: {"before": before[label], "after": decode_counters(s)} for label, s in stacks.items()}
        finally:
            for stack in stacks.values():
                stack.stop()
            for f in logs.values():
                f.close()

    top = best(runs)
    agg_label, pd_label = runs
    result = comparison(runs, pd_label, agg_label, compare, decode_counters=counters)
    for label, repeat in top.items():
        print(format_summary(f"{label:<38}", repeat.summary))
    print("disaggregated / aggregated: " + ", ".join(
        f"{k} {v:.2f}" for k, v in result.items() if k.endswith("ratio") and v is not None))
    paths = write_report(args.out, "disagg", {"workload": dataclasses.asdict(cfg), "model": args.model,
                                              "kv_cache_memory": args.kv_cache_memory,
                                              "max_local_prefill_tokens": args.max_local_prefill_tokens},
                         {label: (r.summary, r.results) for label, r in top.items()}, extra={"comparison": result})
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
