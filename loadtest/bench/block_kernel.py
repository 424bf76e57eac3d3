"""The gguf block kernel's two loop nests (kernels/blocks_cpu.py): AVX2 against AVX-512 VNNI panels.

    python -m loadtest.bench.block_kernel [--rows 1,2,8,32] [--model-shape smollm2-135m]

One decode step's linear layers of the model shape (``loadtest.tools.synth_model``'s shapes), as
``--quantization gguf`` holds a GGUF of Q4 layers: every decoder layer's weights on 4-bit levels
(each layer its own random weight, so a step streams them as a real one does) and the LM head in
8-bit blocks with two activation levels. For each row count M: the step's matmul time on the AVX2
loops (the baseline: ``block_mm`` without panels) and on the panels, each call including its
activations' rounding, and the same step's int8 products (``kernels/int8_cpu.py``'s kernel, from
13 rows ``torch._int_mm``; integer products only, without the activations' quantization that an
int8 layer adds) for reference. Checks that the panels give the AVX2 loops' bits on the way. Writes
``block_kernel.json`` and ``.png`` under --out.
"""

from __future__ import annotations

import platform
from pathlib import Path

from loadtest.bench.int8_kernel import step_args
from loadtest.bench.int8_kernel import time_step as time_weights
from loadtest.tools.report import save_report
from shared.telemetry.plot import figure


def step_layers(shape_name: str, vocab_size: int = 49152):
    """The step's weights as ``BlockWeight``s (4-bit decoder layers, an 8-bit LM head with two
    activation levels) and as int8 matrices of the same shapes."""
    import dataclasses

    import torch

    from kernels.blocks_cpu import BLOCK
    from loadtest.tools.synth_model import SHAPES
    from shared.model.quant import quantize_blocks

    s = SHAPES[shape_name]
    shapes = s.step_linear_shapes()
    gen = torch.Generator().manual_seed(0)
    blocks, int8 = [], []
    for n, k in shapes:  # levels 0..15 with a float16 step and offset per block, as Q4_1
        q = torch.randint(0, 16, (n, k // BLOCK, BLOCK), generator=gen).float()
        d = (torch.rand(n, k // BLOCK, 1, generator=gen) * 0.01 + 0.001).half().float()
        blocks.append(quantize_blocks((q * d - 8 * d).reshape(n, k)))
        int8.append(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen))
    head = quantize_blocks(torch.randn(vocab_size, s.hidden_size, generator=gen) * 0.02)
    blocks.append(dataclasses.replace(head, act_levels=2))
    int8.append(torch.randint(-127, 128, (vocab_size, s.hidden_size), dtype=torch.int8, generator=gen))
    return blocks, int8


def time_step(calls, repeats: int) -> float:
    """The fastest of ``repeats`` passes through ``calls``."""
    return time_weights(lambda call: call(), calls, repeats)


def main(argv: list[str] | None = None) -> int:
    args = step_args(argv, "block_kernel", __doc__, rows="1,2,8,32", model_shape="smollm2-135m", repeats=5)

    import torch

    from kernels import blocks_cpu, int8_cpu

    if not blocks_cpu.packs():
        print(f"no panel kernel here ({blocks_cpu.identity()}; it needs AVX-512 VNNI): nothing to compare")
        return 2
    int8_cpu.load()
    blocks, int8 = step_layers(args.model_shape)
    sums = [int8_cpu.row_sums(w) for w in int8]
    nbytes = sum(w.nbytes for w in blocks)
    print(f"{args.model_shape}: {len(blocks)} block weights, {nbytes / 1e6:.0f} MB read per step; "
          f"{torch.get_num_threads()} threads; {blocks_cpu.identity()}")
    gen = torch.Generator().manual_seed(1)
    rows = []
    for m in map(int, args.rows.split(",")):
        x = {k: torch.randn(m, k, generator=gen) for k in {w.in_features for w in blocks}}
        xq = {k: torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen) for k in x}
        for w in (blocks[0], blocks[-1]):
            avx2 = blocks_cpu.block_mm(x[w.in_features], w.qs, w.d, w.m, w.act_levels)
            panels = blocks_cpu.block_mm(x[w.in_features], w.qs, w.d, w.m, w.act_levels, w.panels)
            assert torch.equal(avx2, panels), "the panels must give the AVX2 loops' bits"
        base = time_step([lambda w=w: blocks_cpu.block_mm(x[w.in_features], w.qs, w.d, w.m, w.act_levels)
                          for w in blocks], args.repeats)
        packed = time_step([lambda w=w: blocks_cpu.block_mm(x[w.in_features], w.qs, w.d, w.m, w.act_levels,
                                                            w.panels) for w in blocks], args.repeats)
        ref = time_step([lambda w=w, s=s: int8_cpu.int8_mm(xq[w.shape[1]], w, s) for w, s in zip(int8, sums)],
                        args.repeats)
        row = {"rows": m, "avx2_ms": base * 1e3, "panels_ms": packed * 1e3, "int8_products_ms": ref * 1e3,
               "speedup": base / packed, "panels_over_int8": packed / ref}
        rows.append(row)
        print(f"M={m:3d}: AVX2 loops {row['avx2_ms']:7.2f} ms, panels {row['panels_ms']:7.2f} ms "
              f"({row['speedup']:.2f}x); int8 products {row['int8_products_ms']:7.2f} ms", flush=True)
    report = {"model_shape": args.model_shape, "weight_bytes": nbytes, "threads": torch.get_num_threads(),
              "processor": platform.processor(), "kernel": blocks_cpu.identity(), "rows": rows}
    save_report(args.out, "block_kernel", report, plot, indent=2)
    return 0


def plot(path: Path, report: dict) -> None:
    rows = report["rows"]
    ms = [r["rows"] for r in rows]
    with figure(path, figsize=(6, 4)) as (fig, ax):
        ax.plot(ms, [r["avx2_ms"] for r in rows], "o-", label="gguf, AVX2 loops")
        ax.plot(ms, [r["panels_ms"] for r in rows], "o-", label="gguf, VNNI panels")
        ax.plot(ms, [r["int8_products_ms"] for r in rows], "o--", label="int8 products (reference)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("activation rows (batch)")
        ax.set_ylabel("ms per decode step's linear layers")
        ax.set_title(f"{report['model_shape']}, {report['threads']} threads")
        ax.set_ylim(bottom=0)
        ax.legend()


if __name__ == "__main__":
    raise SystemExit(main())
