"""What one int8 level of activations can reach: ways of quantizing a token's activations, simulated.

    python -m loadtest.bench.activation_schemes [--tokens 3072] [--window 512] [--lm-head-levels 1|2]
                                               [--out DIR]

The default precision (``int8``) quantizes each linear layer's input per token in one int8 level;
``int8-precise`` spends a second level on what the first rounded off and reaches float32's top
token far more often (``loadtest.bench.quality``), at up to twice the matmul work. This asks whether
some single-level scheme closes the gap. Each scheme below replaces how ``int8``'s activations are
rounded, simulated in float (round to the scheme's grid, multiply back, then a float product with
``int8``'s own weights, smoothing and LM head), and is scored as ``quality`` scores a precision:
teacher-forced top-1 agreement and mean KL against float32 on the shipped corpus.

- ``engine-int8``: the engine's own int8 path, not simulated (asymmetric per token, exact int32);
- ``symmetric``: one scale per token, its largest |value| mapped to 127;
- ``asymmetric``: the token's range [min(x, 0), max(x, 0)] in 255 steps (what the engine does);
- ``asymmetric-outliers-32``: as asymmetric, with each layer's 32 largest input channels (largest
  calibrated range after smoothing) in a group of their own with its own scale and zero point;
- ``blocks-64``: a symmetric scale for every block of 64 consecutive channels of a token, as
  llama.cpp's Q8 activation blocks do (the engine would need a kernel that scales each block's sums);
- ``two-levels``: two symmetric levels, as ``int8-precise`` does for activations (not its weights).

With ``--lm-head-levels 2`` the LM head's weight is stored in two int8 levels, as ``int8-precise``
stores it (the rest stays ``int8``'s), to see what the weights cost on top of the activations.

``engine-int8`` against ``asymmetric`` shows the noise: the same rounding computed two ways (float
against exact integer sums) moves the top token wherever float32's two best are nearly tied.
Prints a table and writes ``activation_schemes.json`` and ``activation_schemes.png`` under --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from loadtest.bench.quality import CORPUS, TARGET_TOP1, cpu_name, load_engine, window_stats, windows
from loadtest.tools.report import save_report
from shared.model import quant
from shared.model.quant import Int8Weight, _per_row, observe, quantize_rows
from shared.telemetry.plot import figure


def _grid_sym(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(x / scale).clamp(-127, 127) * scale


def _grid_asym(x: torch.Tensor) -> torch.Tensor:
    """The engine's own one-level rounding (``quantize_rows``), multiplied back."""
    q, scale, zero = quantize_rows(x)
    return (q.float() - zero) * scale


def _grid_two_levels(x: torch.Tensor) -> torch.Tensor:
    """``int8-precise``'s two symmetric levels (``quantize_rows(levels=2)``), multiplied back and added."""
    q, scale, _ = quantize_rows(x, levels=2)
    back = q.float() * scale
    return back[:x.shape[0]] + back[x.shape[0]:]


def _grid_blocks(block: int):
    def grid(x: torch.Tensor) -> torch.Tensor:
        k = x.shape[1]
        pad = -k % block
        xb = torch.nn.functional.pad(x, (0, pad)).view(x.shape[0], -1, block)
        scale = xb.abs().amax(2, keepdim=True).clamp_min(1e-12) / 127
        return (torch.round(xb / scale).clamp(-127, 127) * scale).view(x.shape[0], -1)[:, :k]
    return grid


def _grid_outliers(channels: dict[int, torch.Tensor]):
    """Asymmetric, with the channels of ``channels[id(weight)]`` rounded as a group of their own."""
    def grid(x: torch.Tensor, weight) -> torch.Tensor:
        top = channels[id(weight)]
        rest = torch.ones(x.shape[1], dtype=torch.bool)
        rest[top] = False
        out = torch.empty_like(x)
        out[:, top] = _grid_asym(x[:, top])
        out[:, rest] = _grid_asym(x[:, rest])
        return out
    return grid


@contextmanager
def simulated(grid, pass_weight: bool = False):
    """``shared.model.quant``'s int8 product replaced by: the activations (smoothed) rounded by
    ``grid``, times the int8 weights dequantized, in float32."""
    real = quant.int8_linear

    def product(x, w, bias=None):
        x2 = x.reshape(-1, x.shape[-1]).float()
        if w.inv_smooth is not None:
            x2 = x2 * w.inv_smooth
        xd = grid(x2, w) if pass_weight else grid(x2)
        out = xd @ (w.qweight.float() * w.scale[:, None]).T
        if w.qweight2 is not None:
            out = out + xd @ (w.qweight2.float() * w.scale2[:, None]).T
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)

    quant.int8_linear = product
    try:
        yield
    finally:
        quant.int8_linear = real


def _linear_slots(model) -> list[tuple[object, str]]:
    """(owner, attribute) of every linear weight of a model: each decoder layer's, then the LM head."""
    return [(layer, n) for layer in model.layers for n in ("qkv", "o_proj", "gate_up", "down")] + [(model, "lm_head")]


def outlier_channels(model, reference, token_ids: list[int], count: int) -> dict[int, torch.Tensor]:
    """For each int8 weight of ``model``: the ``count`` input channels with the largest range over
    ``token_ids`` after smoothing (measured on the float ``reference``, as calibration does)."""
    slots = _linear_slots(reference)
    saved = [getattr(owner, name) for owner, name in slots]
    try:
        for (owner, name), w in zip(slots, saved):
            setattr(owner, name, observe(w))
        for ids in windows(token_ids, 512):
            reference.prefill_logits(ids)
        observed = [getattr(owner, name).act_amax for owner, name in slots]
    finally:
        for (owner, name), w in zip(slots, saved):
            setattr(owner, name, w)
    out = {}
    for (owner, name), amax in zip(_linear_slots(model), observed):
        w = getattr(owner, name)
        smoothed = amax * w.inv_smooth if w.inv_smooth is not None else amax
        out[id(w)] = smoothed.argsort(descending=True)[:count]
    return out


def two_level_head(weight: torch.Tensor, head):
    """``int8``'s LM head (same smoothing) with its weight in two int8 levels, the second holding
    what the first rounded off."""
    w = weight.float() if head.inv_smooth is None else weight.float() / head.inv_smooth[None, :]
    q, scale = _per_row(w)
    q2, scale2 = _per_row(w - q.float() * scale[:, None])
    return Int8Weight(q, scale, head.inv_smooth, q2, scale2, head.act_levels)


def main(argv: list[str] | None = None) -> int:
    from shared.model.registry import DEFAULT_MODEL  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or path (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=3072, help="the corpus's first N tokens (default: %(default)s)")
    p.add_argument("--window", type=int, default=512, help="tokens per teacher-forced prefill")
    p.add_argument("--lm-head-levels", type=int, choices=(1, 2), default=1,
                   help="int8 levels of the LM head's weight (2: as int8-precise stores it)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/quality/activation_schemes"))
    args = p.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    started = time.perf_counter()
    reference = load_engine(args.model, "float32").model
    engine = load_engine(args.model, "int8")
    model, tok = engine.model, engine.tokenizer
    if args.lm_head_levels == 2:
        model.lm_head = two_level_head(reference.lm_head, model.lm_head)
    corpus = tok.encode(CORPUS.read_text())[:args.tokens]
    calibration = tok.encode(CORPUS.read_text())[args.tokens:args.tokens + 1024] or corpus
    schemes = {
        "engine-int8": None,
        "symmetric": (_grid_sym, False),
        "asymmetric": (_grid_asym, False),
        "asymmetric-outliers-32": (_grid_outliers(outlier_channels(model, reference, calibration, 32)), True),
        "blocks-64": (_grid_blocks(64), False),
        "two-levels": (_grid_two_levels, False),
    }
    chunks = windows(corpus, args.window)
    refs = [reference.prefill_logits(ids) for ids in chunks]
    results = {}
    for name, scheme in schemes.items():
        totals = {"positions": 0, "top1_equal": 0, "kl_sum": 0.0}
        with simulated(*scheme) if scheme else _nothing():
            for ids, ref in zip(chunks, refs):
                for key, value in window_stats(ref, model.prefill_logits(ids)).items():
                    totals[key] += value
        results[name] = {"top1_agreement": totals["top1_equal"] / totals["positions"],
                         "kl": totals["kl_sum"] / totals["positions"]}
        print(f"{name:<24} top-1 {results[name]['top1_agreement']:.2%}  KL {results[name]['kl']:.5f}  "
              f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    report = {"model": engine.model_id, "cpu": cpu_name(), "num_threads": torch.get_num_threads(),
              "corpus_tokens": len(corpus), "window": args.window, "lm_head_levels": args.lm_head_levels,
              "target_top1": TARGET_TOP1,
              "schemes": results, "elapsed_s": round(time.perf_counter() - started, 1)}
    print(f"{report['model']} on {report['cpu']}: {len(corpus)} corpus tokens, int8 weights (LM head in "
          f"{args.lm_head_levels} level(s)), activations rounded by")
    for name, r in results.items():
        print(f"  {name:<24} top-1 {r['top1_agreement']:>7.2%}   KL {r['kl']:.5f}")
    save_report(args.out, "activation_schemes", report, plot)
    return 0


@contextmanager
def _nothing():
    yield


def plot(path: Path, report: dict) -> None:
    names = list(report["schemes"])
    with figure(path, figsize=(8, 4.2)) as (fig, ax):
        ax.bar(names, [100 * report["schemes"][n]["top1_agreement"] for n in names], 0.6)
        ax.axhline(100 * report["target_top1"], color="k", ls="--", lw=1, label=f"target {report['target_top1']:.0%}")
        ax.set_ylim(85, 100)
        ax.set_ylabel("teacher-forced top-1 agreement with float32, %")
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.set_title(f"{report['model']}: int8 weights (LM head in {report['lm_head_levels']} level(s)), "
                     "activations rounded by each scheme "
                     f"({report['corpus_tokens']} tokens)\n{report['cpu']}", fontsize=9)


if __name__ == "__main__":
    raise SystemExit(main())
