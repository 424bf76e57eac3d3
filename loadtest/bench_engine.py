"""Engine benchmark: throughput against transformers `generate`, and TTFT with a warm prefix cache.

    python -m loadtest.bench_engine [--batch-sizes 1,8,32] [--out loadtest/results/engine]

Both sides run the same GGUF weights in float32 on this machine, in one run, alternating, best of
``--repeats`` runs each. Throughput: N
concurrent requests of 128 prompt tokens and 128 output tokens (ignore_eos), tokens generated per
second of wall time. TTFT: a 2,000-token prompt, cold vs. with its first 90% already cached.
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


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    rows = result["throughput"]
    xs = range(len(rows))
    ax1.bar([x - 0.2 for x in xs], [r["tandem_tok_s"] for r in rows], 0.4, label="tandem engine")
    ax1.bar([x + 0.2 for x in xs], [r["transformers_tok_s"] for r in rows], 0.4, label="transformers generate")
    for x, r in zip(xs, rows):
        ax1.annotate(f"{r['ratio']:.2f}x", (x - 0.2, r["tandem_tok_s"]), ha="center", va="bottom")
    ax1.set_xticks(list(xs), [str(r["concurrency"]) for r in rows])
    ax1.set_xlabel("concurrent requests (128 in / 128 out)")
    ax1.set_ylabel("output tokens / s")
    ax1.legend()
    t = result["ttft"]
    ax2.bar(["cold", f"{int(result['config']['ttft_cached_fraction'] * 100)}% cached"],
            [t["cold_p50_s"] * 1000, t["warm_p50_s"] * 1000], color=["tab:gray", "tab:green"])
    ax2.set_ylabel(f"TTFT of a {t['prompt_len']}-token prompt (ms, p50)")
    fig.suptitle(f"{result['model']} on {result['device']} ({result['host']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    from shared.engine import EngineConfig, LLMEngine, warmup
    from shared.model.registry import resolve_model
    from shared.telemetry.logs import configure_logging

    configure_logging("bench")
    source = resolve_model(args.model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine = LLMEngine.from_config(EngineConfig(model=args.model, max_num_seqs=max(batches)))
    warmup(engine)
    hf = AutoModelForCausalLM.from_pretrained(source.path.parent, gguf_file=source.path.name,
                                              dtype=torch.float32).eval()
    vocab = engine.model.cfg.vocab_size
    bench_transformers(hf, 1, argparse.Namespace(prompt_len=16, output_len=4), vocab)  # warm-up
    rows = []
    for b in batches:
        ours_runs, theirs_runs = [], []
        for _ in range(args.repeats):
            ours_runs.append(bench_tandem(engine, b, args))
            theirs_runs.append(bench_transformers(hf, b, args, vocab))
        ours, theirs = max(ours_runs), max(theirs_runs)
        rows.append({"concurrency": b, "tandem_tok_s": ours, "transformers_tok_s": theirs, "ratio": ours / theirs,
                     "tandem_runs": ours_runs, "transformers_runs": theirs_runs})
        print(f"concurrency {b:3d}: tandem {ours:8.1f} tok/s   transformers {theirs:8.1f} tok/s   "
              f"ratio {ours / theirs:.2f}x", flush=True)
    ttft = bench_ttft(engine, args)
    print(f"TTFT {ttft['prompt_len']} tokens: cold {ttft['cold_p50_s'] * 1000:.0f} ms, "
          f"{args.ttft_cached_fraction:.0%} cached {ttft['warm_p50_s'] * 1000:.0f} ms "
          f"({ttft['warm_over_cold']:.1%} of cold)", flush=True)
    result = {
        "model": source.name, "device": str(engine.device), "host": platform.node() or "local",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "throughput": rows, "ttft": ttft,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "engine.png")
    print(f"wrote {out / 'engine.json'} and {out / 'engine.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
