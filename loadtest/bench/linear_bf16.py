"""A decode step's linear layers on the gguf panels against oneDNN's bfloat16 and int8 GEMMs.

    python -m loadtest.bench.linear_bf16 [--rows 16,32,64] [--rounds 7]

For the default model's shapes (SmolLM2-135M, ``loadtest.bench.linear``'s ``SHAPES``: 30 layers of
fused q/k/v, o, fused gate/up and down, and the LM head), one step's matmuls at M rows, each layer
its own random weight (a step streams them as a real one does):

- ``panels``: ``--quantization gguf``'s path (``shared.model.quant.block_linear``: 4-bit decoder
  layers, an 8-bit LM head with two activation levels, the AVX-512 VNNI panels where the CPU has them);
- ``bf16``: torch's bfloat16 matmul (oneDNN; AVX512-BF16 where the CPU has it) on the same weights
  dequantized, float32 activations cast to bfloat16 and the output back to float32, as a bfloat16
  engine's layer would run;
- ``bf16-packed``: the same with each weight reordered once into oneDNN's blocked layout
  (``mkldnn._reorder_linear_weight``, ``mkldnn._linear_pointwise``), as vLLM's CPU linear layers
  keep theirs, so no call pays for the weight's reorder;
- ``float32``: ``F.linear`` on the dequantized weights;
- ``int8``: the ``int8`` path (``int8_linear``: per-token int8 activations, ``torch._int_mm`` or
  ``kernels/int8_cpu.py``'s kernel), activation quantization included.

The formats take turns within each round (this machine is shared: a format timed in a quiet moment
and another in a busy one would mislead), and each format's median over the rounds is reported with
its ratio to the panels. Writes ``linear_bf16.json`` under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from loadtest.bench.linear import SHAPES


def step_weights(rows: int = 32):
    """The step's weights in every format compared: a list of dicts, one per layer use (oneDNN's
    packed bfloat16 weights laid out for ``rows`` activation rows)."""
    import dataclasses

    import torch

    from kernels.blocks_cpu import BLOCK
    from shared.model.quant import quantize_blocks, quantize_int8

    gen = torch.Generator().manual_seed(0)
    layers = []
    for name, n, k, uses in SHAPES:
        for _ in range(uses):
            if name == "lm_head":  # 8-bit blocks, two activation levels (as the engine loads SmolLM2's head)
                blocks = dataclasses.replace(quantize_blocks(torch.randn(n, k, generator=gen) * 0.02), act_levels=2)
            else:  # levels 0..15 with a float16 step and offset per block, as Q4_1
                q = torch.randint(0, 16, (n, k // BLOCK, BLOCK), generator=gen).float()
                d = (torch.rand(n, k // BLOCK, 1, generator=gen) * 0.01 + 0.001).half().float()
                blocks = quantize_blocks((q * d - 8 * d).reshape(n, k))
            w = blocks.dequantize()
            wb = w.to(torch.bfloat16)
            layers.append({"name": name, "panels": blocks, "float32": w, "bf16": wb,
                           "bf16-packed": torch.ops.mkldnn._reorder_linear_weight(wb, rows),
                           "int8": quantize_int8(w)})
    return layers


def calls(fmt: str, layers, xs):
    import torch
    import torch.nn.functional as F

    from shared.model.quant import block_linear, int8_linear

    def one(layer):
        x = xs[layer["float32"].shape[1]]
        if fmt == "panels":
            return lambda: block_linear(x, layer["panels"])
        if fmt == "bf16":
            return lambda: torch.mm(x.to(torch.bfloat16), layer["bf16"].t()).float()
        if fmt == "bf16-packed":
            return lambda: torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), layer["bf16-packed"], None,
                                                               "none", [], "").float()
        if fmt == "float32":
            return lambda: F.linear(x, layer["float32"])
        return lambda: int8_linear(x, layer["int8"])

    return [one(layer) for layer in layers]


def time_pass(fns, clock=time.perf_counter) -> float:
    started = clock()
    for fn in fns:
        fn()
    return clock() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.linear_bf16", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="16,32,64")
    p.add_argument("--formats", default="panels,bf16,bf16-packed,float32,int8")
    p.add_argument("--rounds", type=int, default=7, help="rounds of the formats taking turns; medians reported")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--cpu-time", action="store_true",
                   help="time by this thread's CPU time (with --num-threads 1: the time the work ran, not the "
                        "time other processes held the core)")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/linear_bf16"))
    args = p.parse_args(argv)

    import torch

    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    from kernels import blocks_cpu

    clock = time.thread_time if args.cpu_time else time.perf_counter
    layers = step_weights(max(map(int, args.rows.split(","))))
    formats = args.formats.split(",")
    print(f"{len(layers)} layers; {torch.get_num_threads()} threads; blocks: {blocks_cpu.identity()}; "
          f"oneDNN bf16 hardware: {torch.backends.mkldnn.is_available()}", flush=True)
    gen = torch.Generator().manual_seed(1)
    report = {"processor": platform.processor(), "threads": torch.get_num_threads(), "cpu_time": args.cpu_time,
              "kernel": blocks_cpu.identity(), "rows": []}
    for m in map(int, args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for k in {layer["float32"].shape[1] for layer in layers}}
        fns = {fmt: calls(fmt, layers, xs) for fmt in formats}
        for fmt in formats:  # warm
            time_pass(fns[fmt])
        times = {fmt: [] for fmt in formats}
        for r in range(args.rounds):
            for fmt in formats[r % len(formats):] + formats[:r % len(formats)]:
                times[fmt].append(time_pass(fns[fmt], clock) * 1e3)
        row = {"rows": m, **{f"{fmt}_ms": statistics.median(t) for fmt, t in times.items()},
               "all_ms": times}
        report["rows"].append(row)
        base = row[f"{formats[0]}_ms"]
        print(f"M={m:3d}: " + ", ".join(f"{fmt} {row[f'{fmt}_ms']:7.2f} ms ({base / row[f'{fmt}_ms']:.2f}x)"
                                       for fmt in formats), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "linear_bf16.json").write_text(json.dumps(report, indent=1))
    print(f"saved {args.out / 'linear_bf16.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
