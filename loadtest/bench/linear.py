"""The linear layers of one decode step in each weight format torch offers on this CPU.

    python -m loadtest.bench.linear [--batch-sizes 1,8,32] [--num-threads N]

For the default model's shapes (SmolLM2-135M: fused q/k/v, o, fused gate/up and down in each of
30 layers, and the LM head), times one step's worth of matmuls at M = batch-size rows with random
weights in four formats:

- ``w8a8``: the engine's ``int8`` path (``shared.model.quant.int8_linear``: int8 weights and
  per-token int8 activations, ``torch._int_mm``), the baseline;
- ``w8a8-precise``: ``int8-precise``, activations (and the LM head's weights) in two int8 levels;
- ``int4``: torch's weight-only int4 CPU kernel (``_weight_int4pack_mm_for_cpu``, groups of 32,
  bfloat16 activations), what a Q4 GGUF could load into;
- ``w8-bf16``: weight-only int8 with bfloat16 activations (``_weight_int8pack_mm``);
- ``float32``: ``F.linear``.

Each layer's weights are reused across the timing loop, so they sit in cache where they fit: these
are the kernels' costs, not the step's memory traffic. Prints each format's step total and its
ratio to w8a8, and writes ``linear.json`` and ``linear.png`` under --out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from loadtest.tools.report import save_report

# (name, rows N, columns K, uses per step) for SmolLM2-135M: hidden 576, 9 + 2 x 3 heads of 64,
# intermediate 1536, vocabulary 49152, 30 layers
SHAPES = [("qkv", 960, 576, 30), ("o_proj", 576, 576, 30), ("gate_up", 3072, 576, 30), ("down", 576, 1536, 30),
          ("lm_head", 49152, 576, 1)]
INT4_GROUP = 32


def int4_weight(w):
    """Asymmetric 4-bit groups of INT4_GROUP along K, packed for torch's CPU kernel."""
    import torch  # noqa: PLC0415

    n, k = w.shape
    g = w.view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-6)
    q = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
    zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
    scales_zeros = torch.stack([scale.view(n, -1), zero.view(n, -1)], -1).transpose(0, 1).contiguous()
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros.bfloat16()


def formats(w, x, residual_weight: bool = False):
    """name -> a no-argument call computing x @ w.T in that format (``residual_weight``: w8a8-precise
    keeps this layer's weight in two int8 levels, as it does the LM head's)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    from shared.model.quant import int8_linear, quantize_int8  # noqa: PLC0415

    w8 = quantize_int8(w)
    w8_precise = quantize_int8(w, residual=residual_weight, act_levels=2)
    packed, scales_zeros = int4_weight(w)
    xb = x.bfloat16()
    scale_bf16 = w8.scale.bfloat16()
    return {
        "w8a8": lambda: int8_linear(x, w8),
        "w8a8-precise": lambda: int8_linear(x, w8_precise),
        "int4": lambda: torch._weight_int4pack_mm_for_cpu(xb, packed, INT4_GROUP, scales_zeros),
        "w8-bf16": lambda: torch._weight_int8pack_mm(xb, w8.qweight, scale_bf16),
        "float32": lambda: F.linear(x, w),
    }


def time_call(fn, min_s: float = 0.15) -> float:
    """Median seconds per call over 5 rounds of at least ``min_s`` each."""
    fn()
    calls = 1
    while True:
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - started >= min_s / 5:
            break
        calls *= 2
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - started) / calls)
    return sorted(rounds)[2]


def measure(batch_size: int) -> dict:
    import torch  # noqa: PLC0415

    torch.manual_seed(0)
    step: dict[str, float] = {}
    layers = {}
    for name, n, k, uses in SHAPES:
        calls = formats(torch.randn(n, k), torch.randn(batch_size, k), residual_weight=name == "lm_head")
        layers[name] = {fmt: time_call(fn) * 1e6 for fmt, fn in calls.items()}
        for fmt, us in layers[name].items():
            step[fmt] = step.get(fmt, 0.0) + us * uses / 1e3
    return {"step_ms": step, "layer_us": layers}


def plot(path: Path, report: dict) -> None:
    from loadtest.tools.report import bar_chart  # noqa: PLC0415

    sizes = list(report["batches"])
    fmts = list(report["batches"][sizes[0]]["step_ms"])
    bar_chart(path, [f"batch {b}" for b in sizes],
              {fmt: [report["batches"][b]["step_ms"][fmt] for b in sizes] for fmt in fmts},
              ylabel="ms of matmuls per decode step",
              title=f"SmolLM2-135M linear layers by weight format ({report['num_threads']} threads)")


def main(argv: list[str] | None = None) -> int:
    import torch  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/linear"))
    args = p.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    report: dict = {"num_threads": torch.get_num_threads(), "int4_group": INT4_GROUP, "batches": {}}
    for b in (int(x) for x in args.batch_sizes.split(",")):
        r = report["batches"][str(b)] = measure(b)
        base = r["step_ms"]["w8a8"]
        print(f"batch {b}: " + ", ".join(f"{fmt} {ms:.2f} ms ({ms / base:.2f}x w8a8)"
                                         for fmt, ms in r["step_ms"].items()), flush=True)
    save_report(args.out, "linear", report, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
