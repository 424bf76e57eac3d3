"""Online streams beside batch prompts: what a stream's tokens wait for a lower priority's prefill, with
the prefill in slices (``prefill_slice_ms``) and without, one engine in process, both in one run.

    python -m loadtest.bench.prefill_slice [--slices-ms 0,50,25] [--online 4] [--batch-prompt-tokens 256]
                                           [--rounds 3] [--out loadtest/results/prefill_slice]

``--online`` greedy requests of priority 0 (``--online-prompt-tokens`` tokens in, ``--online-tokens``
out) decode while ``--batch-prompts`` prompts of priority 2 (``--batch-prompt-tokens`` each, one output
token, so each is a prefill) arrive one at a time: the next is added as soon as the last ends. The
decode step is compiled (``--compile on``, the workers' default; decode rows go into a step's prefill
forward when eager, and nothing stops for them). Every prompt is new (random tokens), so the prefix
cache hits nothing. Each setting of ``prefill_slice_ms`` runs once per round, in a rotated order per
round, on the same engine; ``0`` (no slices) is the baseline. The work is the same in every run, so
its wall-clock time (``makespan``: the online streams' first tokens to the end of the last of both)
shows what slices cost, if anything; the batch's own end (its last prompt's) moves later by the
online work that now goes first. Per setting, pooled over rounds: the online inter-token latency (the
wall-clock gap between two tokens of a stream) p50 / p90 / p99 / max, the makespan and the batch's
end, with ratios to the baseline; and each run's figures. Writes ``prefill_slice.json`` and
``prefill_slice.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from loadtest.tools.report import bar_chart
from shared.model.precision import QUANTIZATION_METHODS
from shared.telemetry.measure import percentile


def run_once(engine, slice_ms: float, args, rng: random.Random, tag: str) -> dict:
    """The online streams from their first token to their last, batch prompts beside them throughout."""
    from shared.engine import SamplingParams  # noqa: PLC0415

    engine.config.prefill_slice_ms = slice_ms
    vocab = engine.model.cfg.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(n)]

    online_ids = [f"{tag}-online-{i}" for i in range(args.online)]
    stream = SamplingParams(max_tokens=args.online_tokens, temperature=0.0, ignore_eos=True)
    for rid in online_ids:
        engine.add_request(rid, prompt(args.online_prompt_tokens), stream, priority=0)
    times: dict[str, list[float]] = {rid: [] for rid in online_ids}
    while any(not t for t in times.values()):  # their prompts
        for out in engine.step():
            times[out.request_id].append(time.perf_counter())
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    num_batch, batch_waiting, batch_end = 0, None, 0.0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        if batch_waiting is None and num_batch < args.batch_prompts:
            batch_waiting = f"{tag}-batch-{num_batch}"
            engine.add_request(batch_waiting, prompt(args.batch_prompt_tokens), one_token, priority=2)
        for out in engine.step():
            if out.request_id == batch_waiting:
                num_batch, batch_waiting, batch_end = num_batch + 1, None, time.perf_counter() - started
            else:
                times[out.request_id].extend([time.perf_counter()] * len(out.new_token_ids))
    pairs = [(a, b) for t in times.values() for a, b in zip(t, t[1:])]
    return {"slice_ms": slice_ms, "makespan_s": time.perf_counter() - started, "batch_end_s": batch_end,
            "itl_s": [b - a for a, b in pairs],
            "itl_beside_s": [b - a for a, b in pairs if b <= started + batch_end],
            "online_tokens": len(pairs), "batch_prompts": num_batch}


def summarize(runs: list[dict]) -> dict:
    """ITL percentiles of every gap (``itl_*``) and of the gaps while batch prompts ran (``beside_*``,
    with how many online tokens came then)."""
    figures = {"makespan_s": sum(r["makespan_s"] for r in runs), "batch_end_s": sum(r["batch_end_s"] for r in runs),
               "beside_online_tokens": sum(len(r["itl_beside_s"]) for r in runs)}
    for name, key in (("itl", "itl_s"), ("beside_itl", "itl_beside_s")):
        gaps = [g for r in runs for g in r[key]]
        figures |= {f"{name}_p50_s": percentile(gaps, 50), f"{name}_p90_s": percentile(gaps, 90),
                    f"{name}_p99_s": percentile(gaps, 99), f"{name}_max_s": max(gaps),
                    f"{name}_mean_s": statistics.fmean(gaps)}
    return figures


def compare(pooled: dict[float, dict], baseline: float) -> dict[float, dict]:
    """Each setting's figures over the baseline's."""
    base = pooled[baseline]
    return {s: {k: v / base[k] for k, v in p.items() if base[k]} for s, p in pooled.items()}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.prefill_slice", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--slices-ms", default="0,50,25", help="prefill_slice_ms settings; the first is the baseline")
    p.add_argument("--online", type=int, default=4, help="online streams (priority 0)")
    p.add_argument("--online-prompt-tokens", type=int, default=64)
    p.add_argument("--online-tokens", type=int, default=96, help="tokens each stream generates")
    p.add_argument("--batch-prompts", type=int, default=8, help="batch prompts per run (priority 2)")
    p.add_argument("--batch-prompt-tokens", type=int, default=256, help="tokens of each batch prompt")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile", default="on", choices=["on", "off"])
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("loadtest/results/prefill_slice"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    from shared.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: PLC0415

    args = parse_args(argv)
    settings = [float(s) for s in args.slices_ms.split(",")]
    engine = LLMEngine.from_config(EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                                num_threads=args.num_threads, kv_cache_memory=256 << 20,
                                                max_num_seqs=args.online + 2, compile=args.compile))
    engine.generate([[11 + i for i in range(32)]], SamplingParams(max_tokens=8, temperature=0.0))  # warm
    rng = random.Random(args.seed)
    runs: dict[float, list[dict]] = {s: [] for s in settings}
    for rnd in range(args.rounds):
        order = settings[rnd % len(settings):] + settings[:rnd % len(settings)]
        for s in order:
            run = run_once(engine, s, args, rng, f"r{rnd}-s{s:g}")
            runs[s].append(run)
            beside = run["itl_beside_s"]
            print(f"round {rnd + 1}, prefill_slice_ms {s:g}: online ITL while the batch ran p50/max "
                  f"{percentile(beside, 50) * 1e3:.0f}/{max(beside) * 1e3:.0f} ms ({len(beside)} tokens); "
                  f"makespan {run['makespan_s']:.2f} s, batch ends at {run['batch_end_s']:.2f} s", flush=True)
    pooled = {s: summarize(r) for s, r in runs.items()}
    ratios = compare(pooled, settings[0])

    def ms(p: dict, name: str) -> str:
        return "/".join(f"{p[f'{name}_{q}_s'] * 1e3:.0f}" for q in ("p50", "p90", "p99", "max"))

    def x(r: dict, name: str) -> str:
        return "/".join(f"{r[f'{name}_{q}_s']:.2f}x" for q in ("p50", "p90", "p99", "max"))

    for s in settings:
        p, r = pooled[s], ratios[s]
        print(f"prefill_slice_ms {s:g}: online ITL p50/p90/p99/max while the batch ran {ms(p, 'beside_itl')} ms "
              f"({x(r, 'beside_itl')}; {p['beside_online_tokens']} tokens), overall {ms(p, 'itl')} ms "
              f"({x(r, 'itl')}); makespan {p['makespan_s']:.2f} s ({r['makespan_s']:.3f}x), the batch's end "
              f"{p['batch_end_s']:.2f} s ({r['batch_end_s']:.2f}x)")
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "prefill_slice.json").write_text(json.dumps(
        {"config": config, "decode_step": engine.decode_step(), "pooled": {f"{s:g}": p for s, p in pooled.items()},
         "ratios_to_baseline": {f"{s:g}": r for s, r in ratios.items()},
         "runs": {f"{s:g}": [{k: v for k, v in run.items() if not k.startswith("itl")} for run in rs]
                  for s, rs in runs.items()}}, indent=1))
    labels = [f"{s:g} ms slices" if s else "no slices" for s in settings]
    bar_chart(args.out / "prefill_slice.png", ["p50", "p90", "p99", "max"],
              {label: [pooled[s][f"beside_itl_{q}_s"] * 1e3 for q in ("p50", "p90", "p99", "max")]
               for label, s in zip(labels, settings)},
              ylabel="ms", title="online inter-token latency while batch prompts run")
    print(f"wrote {args.out / 'prefill_slice.json'} {args.out / 'prefill_slice.png'}")
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
