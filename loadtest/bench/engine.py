"""Engine benchmark: throughput against transformers `generate`, and TTFT with a warm prefix cache.

    python -m loadtest.bench.engine [--batch-sizes 1,8,32] [--variants fp32,int8,bf16] [--out loadtest/results/engine]

Both sides run the same GGUF weights on this machine, in one run, alternating, best of
``--repeats`` runs each. Throughput: N concurrent requests of 128 prompt tokens and 128 output
tokens (ignore_eos), tokens generated per second of wall time. Every ratio is against
transformers in float32 (its CPU default, and ours).

Variants of the tandem engine (``--variants``):
  fp32  float32, like for like with the baseline
  int8  ``--quantization int8``: int8 weights and per-token int8 activations in the linear layers
  bf16  ``--dtype bfloat16``; transformers in bfloat16 runs too (``--no-transformers-bf16`` skips it)
A quantized variant computes something slightly different: the run also measures, on a fixed
passage, its top-1 agreement with float32 and both perplexities, and prints them beside the speed.

TTFT (default variant): a 2,000-token prompt, cold vs. with its first 90% already cached.
Writes ``engine.json`` and ``engine.png`` under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from loadtest.tools.harness import take_turns
from shared.telemetry.plot import figure


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ttft-prompt-len", type=int, default=2000)
    p.add_argument("--ttft-cached-fraction", type=float, default=0.9)
    p.add_argument("--ttft-repeats", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3,
                   help="throughput runs per side, alternating tandem/transformers; the best of each is kept "
                        "(robust to other load on the machine)")
    p.add_argument("--variants", default="fp32,int8,bf16", help="tandem variants: fp32, int8, bf16 (first: TTFT)")
    p.add_argument("--transformers-bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="also run transformers in bfloat16, the like-for-like baseline of the bf16 variant")
    p.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    p.add_argument("--out", default="loadtest/results/engine")
    return p.parse_args(argv)


def prompts(n: int, length: int, salt: int, vocab: int) -> list[list[int]]:
    return [[(salt * 7919 + i * 104729 + j * 31) % (vocab - 100) + 50 for j in range(length)] for i in range(n)]


def bench_tandem(engine, batch: int, args) -> float:
    from shared.engine import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    ps = prompts(batch, args.prompt_len, salt=batch, vocab=engine.model.cfg.vocab_size)
    t0 = time.perf_counter()
    outs = engine.generate(ps, params)
    elapsed = time.perf_counter() - t0
    assert all(len(o) == args.output_len for o in outs)
    return batch * args.output_len / elapsed


@torch.inference_mode()
def bench_transformers(hf, batch: int, args, vocab: int) -> float:
    ids = torch.tensor(prompts(batch, args.prompt_len, salt=batch + 1000, vocab=vocab))
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                      min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - t0
    assert out.shape[1] == args.prompt_len + args.output_len
    return batch * args.output_len / elapsed


def time_to_first_token(engine, prompt: list[int]) -> float:
    from shared.engine import SamplingParams

    rid = f"ttft-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        if engine.step():
            break
    return time.perf_counter() - t0


def bench_ttft(engine, args) -> dict:
    vocab = engine.model.cfg.vocab_size
    n = args.ttft_prompt_len
    num_cached = int(n * args.ttft_cached_fraction)
    cold, warm = [], []
    for r in range(args.ttft_repeats):
        base = prompts(1, n, salt=5000 + r, vocab=vocab)[0]
        cold.append(time_to_first_token(engine, base))  # unseen prompt: nothing cached
        other = base[:num_cached] + prompts(1, n - num_cached, salt=9000 + r, vocab=vocab)[0]
        hit_before = engine.stats().num_cached_prompt_tokens
        warm.append(time_to_first_token(engine, other))  # shares its first 90% with `base`
        hit = engine.stats().num_cached_prompt_tokens - hit_before
    return {"prompt_len": n, "cached_tokens_last_run": hit, "cold_s": cold, "warm_s": warm,
            "cold_p50_s": statistics.median(cold), "warm_p50_s": statistics.median(warm),
            "warm_over_cold": statistics.median(warm) / statistics.median(cold)}


VARIANTS = {"fp32": {"dtype": "float32"}, "int8": {"quantization": "int8"}, "bf16": {"dtype": "bfloat16"}}


def plot(result: dict, path: Path) -> None:
    with figure(path, 1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2.2, 1]}, dpi=110) as (fig, (ax1, ax2)):
        rows = result["throughput"]
        series = [k for k in rows[0]["tok_s"]]
        width = 0.8 / len(series)
        for j, name in enumerate(series):
            xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(rows))]
            ys = [r["tok_s"][name] for r in rows]
            ax1.bar(xs, ys, width, label=name)
            if not name.startswith("transformers"):
                for x, r in zip(xs, rows):
                    ax1.annotate(f"{r['ratio'][name]:.2f}x", (x, r["tok_s"][name]), ha="center", va="bottom",
                                 fontsize=8)
        ax1.set_xticks(range(len(rows)), [str(r["concurrency"]) for r in rows])
        ax1.set_xlabel("concurrent requests (128 in / 128 out); ratios against transformers fp32")
        ax1.set_ylabel("output tokens / s")
        ax1.legend(fontsize=8)
        t = result["ttft"]
        ax2.bar(["cold", f"{int(result['config']['ttft_cached_fraction'] * 100)}% cached"],
                [t["cold_p50_s"] * 1000, t["warm_p50_s"] * 1000], color=["tab:gray", "tab:green"])
        ax2.set_ylabel(f"TTFT of a {t['prompt_len']}-token prompt (ms, p50)")
        fig.suptitle(f"{result['model']} on {result['device']} ({result['host']}, {result['threads']} threads)")


def _variants(args) -> list[str]:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}: choose from {', '.join(VARIANTS)}")
    return variants


def load_sides(args, source, variants: list[str], batches: list[int]) -> tuple[dict, dict]:
    """The tandem engine in each variant (warmed up) and the transformers baselines, by name."""
    from transformers import AutoModelForCausalLM

    from shared.engine import EngineConfig, LLMEngine, warmup

    engines = {}
    for v in variants:
        engines[f"tandem {v}"] = LLMEngine.from_config(
            EngineConfig(model=args.model, max_num_seqs=max(batches), **VARIANTS[v]))
        warmup(engines[f"tandem {v}"])
    baselines = {"transformers fp32": AutoModelForCausalLM.from_pretrained(
        source.path.parent, gguf_file=source.path.name, dtype=torch.float32).eval()}
    if args.transformers_bf16:
        baselines["transformers bf16"] = AutoModelForCausalLM.from_pretrained(
            source.path.parent, gguf_file=source.path.name, dtype=torch.bfloat16).eval()
    return engines, baselines


def throughput_row(b: int, runs: dict[str, list[float]]) -> dict:
    """One concurrency's best runs, and their ratios against transformers fp32 and the same precision."""
    best = {name: max(r) for name, r in runs.items()}
    base = best["transformers fp32"]
    ratio = {name: v / base for name, v in best.items()}
    # the same precision on both sides: fp32 vs fp32, bf16 vs bf16 (int8 has no transformers twin)
    same = {f"tandem {d}": best[f"tandem {d}"] / best[f"transformers {d}"] for d in ("fp32", "bf16")
            if f"tandem {d}" in best and f"transformers {d}" in best}
    print(f"concurrency {b:3d}: " + "   ".join(f"{n} {best[n]:7.1f} tok/s ({ratio[n]:.2f}x)" for n in best),
          flush=True)
    print("    same precision as transformers: " + ", ".join(f"{n} {r:.2f}x" for n, r in same.items()), flush=True)
    return {"concurrency": b, "tok_s": best, "ratio": ratio, "ratio_same_dtype": same, "runs": runs}


def bench_throughput(engines: dict, baselines: dict, batches: list[int], args, vocab: int) -> list[dict]:
    for hf in baselines.values():
        bench_transformers(hf, 1, argparse.Namespace(prompt_len=16, output_len=4), vocab)  # warm-up
    rows = []
    for b in batches:
        # in turns, so that load from elsewhere hits every side alike
        runs = take_turns({**{name: lambda _, e=engine: bench_tandem(e, b, args) for name, engine in engines.items()},
                           **{name: lambda _, hf=hf: bench_transformers(hf, b, args, vocab)
                              for name, hf in baselines.items()}}, args.repeats)
        rows.append(throughput_row(b, runs))
    return rows


def measure_quality(engines: dict, variants: list[str], source, tokenizer) -> dict:
    """Each quantized variant against float32 on a fixed passage: top-1 agreement, KL, perplexities."""
    from shared.model.loader import load_model
    from shared.model.quant import EVAL_PASSAGE, compare_models

    fp32_ref = engines["tandem fp32"].model if "tandem fp32" in engines else None
    qualities = {}
    for v in variants:
        if v == "fp32":
            continue
        if fp32_ref is None:
            fp32_ref = load_model(source.path, source.format, torch.device("cpu"), torch.float32)
        q = qualities[f"tandem {v}"] = compare_models(fp32_ref, engines[f"tandem {v}"].model,
                                                    tokenizer.encode(EVAL_PASSAGE))
        print(f"tandem {v} vs float32 on a {q['tokens']}-token passage: top-1 agreement {q['top1_agreement']:.1%}, "
              f"KL {q['kl']:.4f}, perplexity {q['perplexity_reference']:.2f} -> {q['perplexity']:.2f}", flush=True)
    return qualities


def write_result(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "engine.png")
    print(f"wrote {out / 'engine.json'} and {out / 'engine.png'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    from shared.model.registry import resolve_model
    from shared.telemetry.logs import configure_logging

    configure_logging("bench")
    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    variants = _variants(args)
    engines, baselines = load_sides(args, source, variants, batches)
    first = engines[f"tandem {variants[0]}"]
    rows = bench_throughput(engines, baselines, batches, args, first.model.cfg.vocab_size)
    qualities = measure_quality(engines, variants, source, first.tokenizer)
    ttft = bench_ttft(first, args)
    print(f"TTFT {ttft['prompt_len']} tokens (tandem {variants[0]}): cold {ttft['cold_p50_s'] * 1000:.0f} ms, "
          f"{args.ttft_cached_fraction:.0%} cached {ttft['warm_p50_s'] * 1000:.0f} ms "
          f"({ttft['warm_over_cold']:.1%} of cold)", flush=True)
    write_result({
        "model": source.name, "device": str(first.device), "host": platform.node() or "local",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "throughput": rows, "quality_vs_fp32": qualities, "ttft": ttft,
    }, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
