"""Which layers need ``int8-precise``'s second int8 level to reach float32's top token 97% of the time.

    python -m loadtest.bench.precise_layers [--tokens 3072] [--window 512] [--out DIR]

``int8`` (the default) agrees with float32 on the top token at about 93% of the shipped corpus's
positions; ``int8-precise`` reaches 97% by giving every linear layer's activations and the LM head's
weight a second int8 level, at 1.4-1.75x the decode step's time. A second level on a few layers
only would cost a fraction of that. Each variant here starts from ``int8`` (SmoothQuant-calibrated,
one level) and adds second levels to some parts, through the engine's exact int8 path:

- ``head w2``: the LM head's weight in two levels; ``head w2a2``: its activations too;
- ``head float``: the LM head in float32 (what no int8 rounding at the head reaches);
- ``<layers> a2 + head w2a2``: the activations of those decoder projections (``qkv``, ``o``,
  ``gate_up``, ``down``, in every layer) in two levels as well.

Scored as ``loadtest.bench.quality`` scores a precision: teacher-forced top-1 agreement and mean KL
against float32 over the corpus, one prefill per window. Prints a table and writes
``precise_layers.json`` under --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from loadtest.bench.quality import CORPUS, TARGET_TOP1, cpu_name, load_engine, teacher_forced
from loadtest.tools.report import save_report
from shared.model.quant import Int8Weight, quantize_int8

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")

# name -> (projections whose activations get two levels, what the LM head gets)
VARIANTS: dict[str, tuple[tuple[str, ...], str]] = {
    "int8": ((), "int8"),
    "head w2": ((), "w2"),
    "head w2a2": ((), "w2a2"),
    "head float": ((), "float"),
    "down a2 + head w2a2": (("down",), "w2a2"),
    "down,o a2 + head w2a2": (("down", "o_proj"), "w2a2"),
    "down,gate_up a2 + head w2a2": (("down", "gate_up"), "w2a2"),
    "down,qkv a2 + head w2a2": (("down", "qkv"), "w2a2"),
    "all a2 + head w2": (PROJECTIONS, "w2"),
    "all a2 + head w2a2": (PROJECTIONS, "w2a2"),
}


def two_level_activations(w: Int8Weight) -> Int8Weight:
    """The same int8 weight (smoothing included), its activations quantized in two levels."""
    return Int8Weight(w.qweight, w.scale, w.inv_smooth, w.qweight2, w.scale2, act_levels=2)


def apply_variant(model, reference, projections: tuple[str, ...], head: str) -> None:
    """Turn an ``int8`` model into a variant (``reference``: the float32 model, for the LM head)."""
    unknown = set(projections) - set(PROJECTIONS)
    if unknown:
        raise ValueError(f"unknown projections {sorted(unknown)} (choose from {', '.join(PROJECTIONS)})")
    for layer in model.layers:
        for name in projections:
            setattr(layer, name, two_level_activations(getattr(layer, name)))
    if head == "w2":
        model.lm_head = quantize_int8(reference.lm_head, residual=True, act_levels=1)
    elif head == "w2a2":
        model.lm_head = quantize_int8(reference.lm_head, residual=True, act_levels=2)
    elif head == "float":
        model.lm_head = reference.lm_head
    elif head != "int8":
        raise ValueError(f"unknown LM head variant {head!r}")


def main(argv: list[str] | None = None) -> int:
    import torch  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=3072, help="the corpus's first N tokens")
    p.add_argument("--window", type=int, default=512, help="tokens per teacher-forced prefill")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/quality/precise_layers"))
    args = p.parse_args(argv)
    started = time.perf_counter()
    reference_engine = load_engine(args.model, "float32")
    reference = reference_engine.model
    corpus = reference_engine.tokenizer.encode(CORPUS.read_text())[:args.tokens]
    models = {}
    for name, (projections, head) in VARIANTS.items():
        model = load_engine(args.model, "int8").model
        apply_variant(model, reference, projections, head)
        models[name] = model

    def progress(done: int, total: int) -> None:
        print(f"window {done}/{total} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    scores = teacher_forced(reference, models, corpus, args.window, progress)
    print(f"{'variant':<30} {'top-1':>7} {'KL':>8}")
    for name, s in scores.items():
        print(f"{name:<30} {100 * s['top1_agreement']:6.2f}% {s['kl']:8.4f}")
    report = {"model": args.model, "cpu": cpu_name(), "num_threads": torch.get_num_threads(),
              "corpus_tokens": len(corpus), "window": args.window, "target_top1": TARGET_TOP1,
              "variants": {name: {"two_level_activations": list(VARIANTS[name][0]), "lm_head": VARIANTS[name][1],
                                  **scores[name]} for name in VARIANTS},
              "elapsed_s": round(time.perf_counter() - started, 1)}
    save_report(args.out, "precise_layers", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
