"""The gguf panel kernel against another version of its source, alternating in one process.

    python -m loadtest.bench.panel_ab --baseline-source /tmp/block_mm_before.cpp [--rows 1,8,16,32,64]
    python -m loadtest.bench.panel_ab --baseline-source /tmp/block_mm_before.cpp --engine --rows 32

``--baseline-source``: a ``kernels/cpu/block_mm.cpp`` of another version (``git show
HEAD:kernels/cpu/block_mm.cpp > /tmp/block_mm_before.cpp``). It is built under another op namespace
(``tandem_blocks_baseline``) beside the current kernel, and the two take turns in every round, so a
busy moment of a shared machine falls on both: the median of the per-round ratios is reported. The
panels' layout must be the same in both (the current ``pack_panels`` packs for both).

Without ``--engine``: one decode step's linear layers (``loadtest.bench.linear_bf16``'s weights),
checking that both give the same bits. With ``--engine``: eager engine steps of the default model
at each batch size (``loadtest.tools.profile_step``'s engines), the kernel swapped between steps.
On a busy machine ``--num-threads 1 --cpu-time`` gives the steadiest ratios.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

NAMESPACE = "tandem_blocks_baseline"


def build_renamed(source: Path, library: str, namespace: str, flags: list[str]):
    """``source``'s ops, its ``TORCH_LIBRARY(library, ...)`` renamed ``namespace`` so that they load
    beside the current build's, built with ``flags``: ``torch.ops.<namespace>``."""
    import torch

    from kernels.cpu_build import build

    text = re.sub(rf"TORCH_LIBRARY\({library},", f"TORCH_LIBRARY({namespace},", source.read_text())
    renamed = Path(tempfile.mkdtemp()) / f"{source.stem}_{namespace}.cpp"
    renamed.write_text(text)
    torch.ops.load_library(str(build(renamed, flags)))
    return getattr(torch.ops, namespace)


def load_baseline(source: Path):
    """The baseline's ``panel_mm``, built from ``source`` under ``NAMESPACE``."""
    from kernels import blocks_cpu

    return build_renamed(source, "tandem_blocks", NAMESPACE, blocks_cpu._FLAGS).panel_mm


def alternate(run_current, run_baseline, rounds: int, clock=time.perf_counter) -> dict:
    """Both timed in every round, in alternating order; medians and the median per-round ratio."""
    run_current(), run_baseline()  # warm
    current, baseline = [], []
    for r in range(rounds):
        pair = [(current, run_current), (baseline, run_baseline)]
        for times, fn in (pair if r % 2 == 0 else pair[::-1]):
            started = clock()
            fn()
            times.append((clock() - started) * 1e3)
    ratios = [b / c for b, c in zip(baseline, current)]
    return {"current_ms": statistics.median(current), "baseline_ms": statistics.median(baseline),
            "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)]}


def linear_layers(baseline_op, rows: list[int], rounds: int, clock) -> list[dict]:
    import torch

    from kernels import blocks_cpu
    from loadtest.bench.linear_bf16 import step_weights

    current_op = blocks_cpu._panel_op
    layers = [layer["panels"] for layer in step_weights()]
    gen = torch.Generator().manual_seed(1)
    results = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {w.in_features for w in layers}}

        def run(op):
            return [op(xs[w.in_features], w.panels, w.shape[0], w.m is not None, w.act_levels) for w in layers]

        assert all(torch.equal(a, b) for a, b in zip(run(current_op), run(baseline_op))), "the bits differ"
        results.append({"rows": m, **alternate(lambda: run(current_op), lambda: run(baseline_op), rounds, clock)})
    return results


def engine_steps(baseline_op, rows: list[int], rounds: int, steps: int, clock, num_threads: int | None) -> list[dict]:
    from kernels import blocks_cpu
    from loadtest.tools.profile_step import add_decoding_args, decoding_engine

    current_op = blocks_cpu._panel_op
    p = argparse.ArgumentParser()
    add_decoding_args(p)
    results = []
    for m in rows:
        engine = decoding_engine(p.parse_args(["--num-threads", str(num_threads)] if num_threads else []), m)

        def run(op):
            blocks_cpu._panel_op = op  # block_mm looks it up at each call
            try:
                for _ in range(steps):
                    engine.step()
            finally:
                blocks_cpu._panel_op = current_op

        result = alternate(lambda: run(current_op), lambda: run(baseline_op), rounds, clock)
        results.append({"rows": m, "steps_per_round": steps, **result})
        del engine
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.panel_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-source", type=Path, required=True)
    p.add_argument("--rows", default="1,8,16,32,64", help="activation rows (with --engine: batch sizes)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--engine", action="store_true", help="time eager engine steps instead of the linear layers")
    p.add_argument("--steps", type=int, default=5, help="with --engine: steps per round")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--cpu-time", action="store_true",
                   help="time by this thread's CPU time (with --num-threads 1: the time the work ran, not the "
                        "time other processes held the core)")
    args = p.parse_args(argv)

    import torch

    from kernels import blocks_cpu

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if not blocks_cpu.packs():
        print(f"no panel kernel here ({blocks_cpu.identity()}): nothing to compare")
        return 2
    baseline = load_baseline(args.baseline_source)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{torch.get_num_threads()} threads; current {blocks_cpu.identity()}", flush=True)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    results = (engine_steps(baseline, rows, args.rounds, args.steps, clock, args.num_threads) if args.engine
               else linear_layers(baseline, rows, args.rounds, clock))
    for r in results:
        lo, hi = r["speedup_range"]
        print(f"{'batch' if args.engine else 'M'}={r['rows']:3d}: current {r['current_ms']:8.2f} ms, baseline "
              f"{r['baseline_ms']:8.2f} ms: {r['speedup']:.3f}x (per-round ratios {lo:.2f}-{hi:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
