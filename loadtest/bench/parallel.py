"""What a tensor-parallel group costs against one process with the same cores.

    python -m loadtest.bench.parallel --tp 3 --pp 2 --out loadtest/results/parallel/zen4

For each configuration an engine is started on ``--model`` (SmolLM2-135M by default, float32):
the baseline is one process with as many threads as the machine has cores (``--baseline-threads``),
then one process with one thread (TP=1), then a group of each ``--tp`` size, one thread per rank.
Measured per configuration: decode tokens/s and step time at each ``--batch-sizes`` (decode-only
steps after the prompts are in, as loadtest.bench.decode times them), the time to first token of
one ``--ttft-prompt-len``-token prompt alone, the share of a decode step rank 0 spends in the
worker's collectives (all-reduces, the logits' gather, the step's broadcast, the stages' hand-overs:
counted by the collectives themselves, waiting for the other ranks included), each rank's resident
memory and rank 0's weight bytes against TP=1's. Pipeline sizes (``--pp``) run at TP=1: their
stages run one after another within a step, so a step is as long as the stages together plus the
hand-overs.

On a CPU with fewer cores than ranks a group cannot beat one process: every rank computes its
share while the others wait in collectives, and ranks share cores. What this reports is what a
group costs here, so that a group across sockets or hosts (or GPUs) can be judged by the same
numbers. Prints ratios against the baseline and writes ``parallel.json`` and ``parallel.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from loadtest.bench.decode import decode_tok_s


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or Hugging Face directory")
    p.add_argument("--tp", default="3", help="tensor-parallel sizes to measure beside TP=1 (default: %(default)s)")
    p.add_argument("--pp", default="2", help="pipeline-parallel sizes to measure, at TP=1 (default: %(default)s; "
                   "empty: none)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128, help="decode requests' prompt length")
    p.add_argument("--ttft-prompt-len", type=int, default=512, help="the prompt whose TTFT is timed")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=2, help="runs per batch size; the fastest is kept")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: each rank on a GPU of its own (cuda:0, 1, ...), "
                   "the collectives over NCCL (default: %(default)s)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None)
    p.add_argument("--compile", default="off", choices=["off", "on"],
                   help="the decode step compiled on every configuration, groups included (default: %(default)s)")
    p.add_argument("--baseline-threads", type=int, default=os.cpu_count() or 1,
                   help="threads of the one-process baseline (default: the machine's cores, %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="write parallel.json and parallel.png here")
    return p.parse_args(argv)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def weight_bytes(model) -> int:
    """Bytes of every weight this process holds (its shard on a rank of a group)."""
    names = ("attn_norm", "qkv", "qkv_bias", "o_proj", "mlp_norm", "gate_up", "down")
    layers = sum(getattr(layer, n).nbytes for layer in model.layers for n in names if getattr(layer, n) is not None)
    head = 0 if model.lm_head is model.embed else model.lm_head.nbytes
    return layers + model.embed.nbytes + model.norm.nbytes + head


def ttft_s(engine, prompt_len: int) -> float:
    from shared.engine import SamplingParams

    vocab = engine.model.cfg.vocab_size
    prompt = [(time.monotonic_ns() + j * 7919) % (vocab - 100) + 50 for j in range(prompt_len)]
    engine.add_request(f"ttft-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def measure(args, tp: int, pp: int, threads: int) -> dict:
    from shared.engine import EngineConfig, LLMEngine, warmup

    batches = [int(b) for b in args.batch_sizes.split(",")]
    torch.set_num_threads(threads)
    engine = LLMEngine.from_config(EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization, tensor_parallel_size=tp,
        pipeline_parallel_size=pp, num_threads=threads, max_num_seqs=max(batches), kv_cache_memory=256 << 20,
        compile=args.compile,
        max_num_batched_tokens=max(512, args.prompt_len)))
    try:
        warmup(engine)
        group = getattr(engine.model, "world", engine.model.group)  # every rank's collectives, rank 0's count
        row = {"tp": tp, "pp": pp, "threads_per_rank": threads, "weight_bytes_rank0": weight_bytes(engine.model),
               "rss_bytes": [rss_bytes(os.getpid())] + [rss_bytes(p.pid) for p in getattr(engine.model, "followers", [])],
               "ttft_s": min(ttft_s(engine, args.ttft_prompt_len) for _ in range(args.repeats)), "batches": []}
        for b in batches:
            best, share = 0.0, None
            for _ in range(args.repeats):
                before = _collective_s(group)
                t0 = time.perf_counter()
                tok_s = decode_tok_s(engine, b, args)
                elapsed = time.perf_counter() - t0
                if tok_s > best:
                    best = tok_s
                    share = None if before is None else (_collective_s(group) - before) / elapsed
            row["batches"].append({"batch": b, "decode_tok_s": best, "step_ms": b / best * 1e3,
                                   "collective_share": share})
        return row
    finally:
        engine.close()


def _collective_s(group) -> float | None:
    """Seconds the group's collectives have taken on this rank (None: a process alone)."""
    return getattr(group, "seconds", None)


def main(argv=None) -> int:
    args = parse_args(argv)
    configs = [("baseline", 1, 1, args.baseline_threads), ("TP=1", 1, 1, 1)]
    configs += [(f"TP={tp}", tp, 1, 1) for tp in (int(t) for t in args.tp.split(",") if t) if tp > 1]
    configs += [(f"PP={pp}", 1, pp, 1) for pp in (int(p) for p in args.pp.split(",") if p) if pp > 1]
    rows = []
    for name, tp, pp, threads in configs:
        row = measure(args, tp, pp, threads) | {"name": name}
        rows.append(row)
        base = rows[0]
        cells = [f"batch {b['batch']}: {b['decode_tok_s']:6.1f} tok/s ({b['decode_tok_s'] / bb['decode_tok_s']:.2f}x)"
                 + ("" if b["collective_share"] is None else f", {b['collective_share']:.0%} in collectives")
                 for b, bb in zip(row["batches"], base["batches"])]
        print(f"{name:<9} {threads} thread(s)/rank: TTFT({args.ttft_prompt_len}) {row['ttft_s'] * 1e3:7.1f} ms "
              f"({row['ttft_s'] / base['ttft_s']:.2f}x); " + "; ".join(cells)
              + f"; rank 0 weights {row['weight_bytes_rank0'] / 2**20:.0f} MiB "
              f"({row['weight_bytes_rank0'] / rows[min(1, len(rows) - 1)]['weight_bytes_rank0']:.2f}x TP=1's), "
              f"RSS per rank {', '.join(f'{r / 2**20:.0f}' for r in row['rss_bytes'])} MiB", flush=True)
    result = {"model": args.model, "precision": f"{args.dtype} + {args.quantization or 'none'}",
              "host": platform.node(), "processor": platform.processor(), "cores": os.cpu_count(),
              "config": vars(args) | {"out": str(args.out)}, "rows": rows}
    if args.out:
        _write(args.out, result)
    return 0


def _write(out: Path, result: dict) -> None:
    from loadtest.tools.report import bar_chart

    out.mkdir(parents=True, exist_ok=True)
    (out / "parallel.json").write_text(json.dumps(result, indent=2))
    rows = result["rows"]
    series = {f"batch {b['batch']}": [r["batches"][i]["decode_tok_s"] for r in rows]
              for i, b in enumerate(rows[0]["batches"])}
    bar_chart(out / "parallel.png", [r["name"] for r in rows], series, ylabel="decode tokens/s",
              title=f"{result['model']} {result['precision']}, {result['cores']} cores")
    print(f"wrote {out / 'parallel.json'} and {out / 'parallel.png'}")


if __name__ == "__main__":
    raise SystemExit(main())
