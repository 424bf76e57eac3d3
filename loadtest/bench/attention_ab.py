"""The compiled decode step's attention kernel against another version of its source, in one process.

    git show HEAD:kernels/cpu/decode_attention.cpp > /tmp/decode_attention_before.cpp
    python -m loadtest.bench.attention_ab --baseline-source /tmp/decode_attention_before.cpp \\
        --batch-sizes 16,32,64 --rounds 9 --num-threads 1 --cpu-time

``--baseline-source`` is built under another op namespace (``tandem_attn_baseline``) with the flags the
kernel had before it used AVX-512 (``BASELINE_FLAGS``) beside the current kernel. One round times one
decode step's attention, all layers, of each version in turn (alternating which goes first), so a busy
moment of a shared machine falls on both; the median of the per-round ratios is reported.

The shapes are the default model's (SmolLM2-135M: 30 layers, 9 query heads over 3 KV heads of 64) on
a float16 pool of 16-position blocks, each sequence ``--context`` positions give or take half a block
(so the lengths are ragged, not multiples of the block size, and the rows past them are masked), its
blocks scattered over a pool twice the batch's need, as a served worker's are. Writes a small
``*.summary.json`` with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from loadtest.bench.panel_ab import alternate, build_renamed

NAMESPACE = "tandem_attn_baseline"
BASELINE_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]
LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 30, 9, 3, 64, 16


def load_baseline(source: Path, namespace: str = NAMESPACE):
    """The ``decode_attention`` of ``source``, built with ``BASELINE_FLAGS`` under ``namespace``."""
    return build_renamed(source, "tandem_attn", namespace, BASELINE_FLAGS).decode_attention


def step_inputs(batch: int, context: int, dtype, seed: int = 0) -> dict:
    """One decode step's attention inputs: per-layer q/k/v and the pool, block tables, masks."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = context + torch.randint(-BLOCK // 2, BLOCK // 2, (batch,), generator=g)  # past positions a row has
    nblk = -(-int(lengths.max()) // BLOCK)
    pool_blocks = 2 * batch * nblk
    cache = torch.randn(pool_blocks, LAYERS, 2, BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    table = torch.randperm(pool_blocks, generator=g)[:batch * nblk]
    valid = torch.arange(nblk * BLOCK)[None, :] < lengths[:, None]
    qkv = [(torch.randn(batch, HEADS, DIM, generator=g), torch.randn(batch, KV_HEADS, DIM, generator=g).to(dtype).float(),
            torch.randn(batch, KV_HEADS, DIM, generator=g).to(dtype).float()) for _ in range(LAYERS)]
    return {"qkv": qkv, "cache": cache, "blocks": table, "valid": valid,
            "src": torch.full(valid.shape, -1, dtype=torch.long)}


def one_step(op, inputs: dict) -> list:
    return [op(q, k, v, inputs["cache"], layer, inputs["blocks"], inputs["valid"], inputs["src"])
            for layer, (q, k, v) in enumerate(inputs["qkv"])]


def compare(current_op, baseline_op, batch: int, context: int, dtype, rounds: int, clock) -> dict:
    import torch

    inputs = step_inputs(batch, context, dtype)
    got, want = one_step(current_op, inputs), one_step(baseline_op, inputs)
    max_diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    same_bits = all(torch.equal(a, b) for a, b in zip(got, want))
    result = alternate(lambda: one_step(current_op, inputs), lambda: one_step(baseline_op, inputs), rounds, clock)
    return {"batch": batch, "dtype": str(dtype).removeprefix("torch."), "same_bits": same_bits,
            "max_abs_diff": max_diff, "current_ms": round(result["current_ms"], 3),
            "baseline_ms": round(result["baseline_ms"], 3), "speedup": round(result["speedup"], 3),
            "speedup_range": [round(r, 3) for r in result["speedup_range"]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.attention_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-source", type=Path, required=True)
    p.add_argument("--batch-sizes", default="16,32,64")
    p.add_argument("--context", type=int, default=135, help="past positions per sequence (give or take 8)")
    p.add_argument("--dtypes", default="float16", help="pool dtypes: float16,bfloat16,float32")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--cpu-time", action="store_true",
                   help="time by this thread's CPU time (with --num-threads 1: the time the work ran)")
    p.add_argument("--avx2", action="store_true",
                   help="time the current source's AVX2 build (what CPUs without AVX-512 run) instead of this CPU's")
    p.add_argument("--out", type=Path, default=None, help="a *.summary.json to write")
    p.add_argument("--cpu", default="", help="the CPU's description, kept in the summary")
    args = p.parse_args(argv)

    import torch

    from kernels import attention_cpu

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if not attention_cpu.load():
        print(f"no attention kernel here ({attention_cpu.identity()}): nothing to compare")
        return 2
    baseline = load_baseline(args.baseline_source)
    current = load_baseline(attention_cpu.SOURCE, "tandem_attn_current_avx2") if args.avx2 else attention_cpu._op
    clock = time.thread_time if args.cpu_time else time.perf_counter
    print(f"{torch.get_num_threads()} threads; current {'AVX2 build' if args.avx2 else attention_cpu.identity()}",
          flush=True)
    results = []
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for batch in map(int, args.batch_sizes.split(",")):
            r = compare(current, baseline, batch, args.context, dtype, args.rounds, clock)
            lo, hi = r["speedup_range"]
            print(f"{r['dtype']} batch={batch:3d}: current {r['current_ms']:7.2f} ms, baseline {r['baseline_ms']:7.2f} ms "
                  f"per step ({LAYERS} layers): {r['speedup']:.2f}x (per-round {lo:.2f}-{hi:.2f}); same bits "
                  f"{r['same_bits']}, max diff {r['max_abs_diff']:.1e}", flush=True)
            results.append(r)
    if args.out:
        summary = {"command": "python -m loadtest.bench.attention_ab " + shlex.join(argv or sys.argv[1:]),
                   "cpu": args.cpu, "build": "avx2" if args.avx2 else attention_cpu.identity(),
                   "num_threads": torch.get_num_threads(), "clock": clock.__name__,
                   "context": args.context, "results": results}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
