"""The few-row int8 CPU kernel (kernels/int8_cpu.py) against torch._int_mm, streaming weights from memory.

    python -m loadtest.bench.int8_kernel [--rows 1,2,4,8] [--model-shape llama-1b]

One decode step's int8 linear layers of the model shape (``loadtest.tools.synth_model``'s shapes),
each layer its own random weight, as a step reads them: the weights do not fit in cache, so each
call streams its weight from memory. For each row count M, the step's matmul time with
``torch._int_mm`` (the baseline) and with the kernel, the weight bytes read per second, and a plain
read of the same bytes (``torch.sum`` over them seen as float32) as the machine's reference. Writes ``int8_kernel.json`` and ``.png`` under --out.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from loadtest.tools.report import save_report
from shared.telemetry.plot import figure


def step_weights(shape_name: str, vocab_size: int = 49152):
    import torch

    from loadtest.tools.synth_model import SHAPES

    s = SHAPES[shape_name]
    shapes = s.step_linear_shapes()
    shapes.append((vocab_size, s.hidden_size))
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen) for shape in shapes]


def time_step(fn, weights, repeats: int) -> float:
    fn(weights[0])
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, time.perf_counter() - t0)
    return best


def step_args(argv: list[str] | None, name: str, doc: str, *, rows: str, model_shape: str,
              repeats: int) -> argparse.Namespace:
    """The options of a kernel bench over one decode step's weights (``loadtest.bench.<name>``)."""
    p = argparse.ArgumentParser(prog=f"python -m loadtest.bench.{name}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=rows, help="activation rows M (the batch of a decode step)")
    p.add_argument("--model-shape", default=model_shape, help="a loadtest.tools.synth_model shape")
    p.add_argument("--repeats", type=int, default=repeats,
                   help="timed passes over the step's weights; the fastest is kept")
    p.add_argument("--out", type=Path, default=Path(f"loadtest/results/{name}"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = step_args(argv, "int8_kernel", __doc__, rows="1,2,4,8", model_shape="llama-1b", repeats=3)

    import torch

    from kernels import int8_cpu

    if not int8_cpu.load():
        print(f"the kernel does not run here ({int8_cpu.identity()}): nothing to compare")
        return 2
    weights = step_weights(args.model_shape)
    sums = [int8_cpu.row_sums(w) for w in weights]
    index = {id(w): i for i, w in enumerate(weights)}
    nbytes = sum(w.numel() for w in weights)
    flat = torch.cat([w.view(-1) for w in weights])[: nbytes // 4 * 4].view(torch.float32)
    read_s = time_step(lambda w: w.sum(), [flat], args.repeats)  # the bytes as float32: a vectorized sum
    del flat
    read_gb_s = nbytes / read_s / 1e9
    print(f"{args.model_shape}: {len(weights)} int8 weights, {nbytes / 1e9:.2f} GB per step; "
          f"plain read {read_gb_s:.1f} GB/s; {torch.get_num_threads()} threads")
    rows = []
    for m in map(int, args.rows.split(",")):
        x = {k: torch.randint(-127, 128, (m, k), dtype=torch.int8) for k in {w.shape[1] for w in weights}}
        base = time_step(lambda w: torch._int_mm(x[w.shape[1]], w.t()), weights, args.repeats)
        kernel = time_step(lambda w: torch.ops.tandem_cpu.int8_mm(x[w.shape[1]], w, sums[index[id(w)]]),
                           weights, args.repeats)
        row = {"rows": m, "int_mm_ms": base * 1e3, "kernel_ms": kernel * 1e3, "speedup": base / kernel,
               "int_mm_gb_s": nbytes / base / 1e9, "kernel_gb_s": nbytes / kernel / 1e9}
        rows.append(row)
        print(f"M={m:3d}: _int_mm {row['int_mm_ms']:7.1f} ms ({row['int_mm_gb_s']:5.1f} GB/s), kernel "
              f"{row['kernel_ms']:7.1f} ms ({row['kernel_gb_s']:5.1f} GB/s): {row['speedup']:.2f}x", flush=True)
    report = {"model_shape": args.model_shape, "weight_bytes": nbytes, "plain_read_gb_s": read_gb_s,
              "threads": torch.get_num_threads(), "processor": platform.processor(), "kernel": int8_cpu.identity(),
              "rows": rows}
    save_report(args.out, "int8_kernel", report, plot, indent=2)
    return 0


def plot(path: Path, report: dict) -> None:
    rows = report["rows"]
    ms = [r["rows"] for r in rows]
    with figure(path, figsize=(6, 4)) as (fig, ax):
        ax.plot(ms, [r["int_mm_gb_s"] for r in rows], "o-", label="torch._int_mm")
        ax.plot(ms, [r["kernel_gb_s"] for r in rows], "o-", label="int8 kernel (VNNI)")
        ax.axhline(report["plain_read_gb_s"], color="gray", linestyle="--", label="plain read")
        ax.set_xlabel("activation rows (batch)")
        ax.set_ylabel("weight bytes read, GB/s")
        ax.set_title(f"{report['model_shape']} step's int8 linear layers, {report['threads']} threads")
        ax.set_ylim(bottom=0)
        ax.legend()


if __name__ == "__main__":
    raise SystemExit(main())
