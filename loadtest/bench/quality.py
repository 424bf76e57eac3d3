"""How far each precision moves the model's output from float32's, on the real default model.

    python -m loadtest.bench.quality [--model PATH] [--precisions float32,bfloat16,int8] [--tokens N]
                               [--window 512] [--max-new-tokens 48] [--out DIR]

Each precision is loaded as a serving worker loads it (``LLMEngine.from_config``: the same model
code, dtype, int8 layers and SmoothQuant calibration) and compared with float32 in two ways:

- **teacher-forced**: the text of ``loadtest/data/quality_corpus.txt`` (original English prose,
  dialogue, code and numbers written for this benchmark and shipped with it; no network) is cut
  into windows of --window tokens, each run as one prefill through the model's forward
  (``LlamaModel.prefill_logits``), and every position's next-token distribution is compared with
  float32's: top-1 agreement (the share of positions whose argmax is float32's) and the mean
  KL(p_float32 || p_precision) in nats. Each window starts without context, so its first positions
  see only a few tokens, as a request's do.
- **greedy text**: each of ``PROMPTS`` (short chat questions, with the model's chat template) is
  answered greedily with --max-new-tokens tokens by the engine itself (prefill and batched decode
  steps, all prompts together; the engine is batch-invariant, so a prompt's tokens do not depend
  on its batch-mates) and compared with float32's answer: the share of prompts answered token for
  token the same, and where the others first differ (the mean index of the first differing token).

Precisions (``PRECISIONS``): float32, bfloat16, float16 (model dtype, no quantization); int8 (the
default on a CPU with VNNI: float32 with W8A8 int8 linear layers, ``shared/model/quant.py``);
int8-precise (activations and the LM head's weights in two int8 levels); bfloat16-int8; gguf
(weight-only blocks of 32 as the GGUF file holds them, activations in 8-bit blocks). Variants of int8 that keep some linear layers in float32, to see which layers cost
the most agreement (not engine options): int8-fp32-head (the LM head), int8-fp32-ends (the first
and last decoder layers), int8-fp32-head-ends (both).

Prints a table and writes ``quality.json`` and ``quality.png`` under --out. The target for the
default precision is a teacher-forced top-1 agreement of at least 97% with float32.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

from loadtest.tools.report import save_report
from shared.telemetry.plot import figure

CORPUS = Path(__file__).parents[1] / "data" / "quality_corpus.txt"
TARGET_TOP1 = 0.97

# name -> (model dtype, quantization, what an int8 model keeps in float32: "head" and/or "ends")
PRECISIONS = {
    "float32": ("float32", "none", ()),
    "bfloat16": ("bfloat16", "none", ()),
    "float16": ("float16", "none", ()),
    "int8": ("float32", "int8", ()),
    "int8-precise": ("float32", "int8-precise", ()),
    "bfloat16-int8": ("bfloat16", "int8", ()),
    "gguf": ("float32", "gguf", ()),
    # a KV pool of another dtype (--kv-cache-dtype) than the default's (float16 under gguf, else the model's)
    "float32-kv-float16": ("float32", "none", (), "float16"),
    "gguf-kv-float32": ("float32", "gguf", (), "float32"),
    "int8-fp32-head": ("float32", "int8", ("head",)),
    "int8-fp32-ends": ("float32", "int8", ("ends",)),
    "int8-fp32-head-ends": ("float32", "int8", ("head", "ends")),
}

PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about autumn leaves.",
    "Give me three tips for a job interview.",
    "What is 17 multiplied by 23?",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Translate 'thank you very much' into French.",
    "Summarise the plot of Romeo and Juliet in one sentence.",
    "What are the three states of matter?",
    "Suggest a name for a friendly robot.",
    "How do I boil an egg?",
    "What does HTTP stand for?",
    "List four planets of the solar system.",
    "Write a short apology for missing a meeting.",
    "What is the difference between a list and a tuple in Python?",
    "Describe a cat to someone who has never seen one.",
    "Give an example of a prime number greater than 50.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a hash table is.",
    "Write one sentence that uses the word 'serendipity'.",
    "How many minutes are there in a day?",
    "What is the boiling point of water in Fahrenheit?",
    "Tell me a fun fact about octopuses.",
]


def window_stats(ref_logits, logits) -> dict[str, float]:
    """Over positions [n, V] of two models' logits: how many share the argmax, and the summed
    KL(softmax(ref) || softmax(logits)) in nats (sums, so that windows add up)."""
    ref = ref_logits.float().log_softmax(-1)
    got = logits.float().log_softmax(-1)
    return {"positions": ref.shape[0], "top1_equal": int((ref.argmax(-1) == got.argmax(-1)).sum()),
            "kl_sum": float((ref.exp() * (ref - got)).sum(-1).sum())}


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    """``token_ids`` cut into consecutive windows of ``window`` tokens (the last may be shorter)."""
    return [token_ids[i:i + window] for i in range(0, len(token_ids), window)]


def teacher_forced(reference, models: dict, token_ids: list[int], window: int = 512,
                   progress=None) -> dict[str, dict]:
    """Each model against ``reference`` (``LlamaModel``s) on ``token_ids``, one prefill per window:
    name -> {positions, top1_agreement, kl}. The reference runs each window once for all models (and
    is not run again where it is one of them);
    ``progress(done, total)`` is called after each window."""
    totals = {name: {"positions": 0, "top1_equal": 0, "kl_sum": 0.0} for name in models}
    chunks = windows(token_ids, window)
    for done, ids in enumerate(chunks, 1):
        ref = reference.prefill_logits(ids)
        for name, model in models.items():
            logits = ref if model is reference else model.prefill_logits(ids)
            for key, value in window_stats(ref, logits).items():
                totals[name][key] += value
        if progress:
            progress(done, len(chunks))
    return {name: {"positions": t["positions"], "top1_agreement": t["top1_equal"] / t["positions"],
                   "kl": t["kl_sum"] / t["positions"]} for name, t in totals.items()}


def greedy(engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The engine's greedy answer to every prompt (all of them in one continuous batch)."""
    from shared.engine import SamplingParams  # noqa: PLC0415

    return engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (or where the shorter one ends); None
    when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_equality(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    """The share of answers equal to the reference's token for token, and for the others the mean
    index of their first differing token."""
    diverged = [d for d in map(first_divergence, reference, outputs) if d is not None]
    return {"prompts": len(outputs), "equal": (len(outputs) - len(diverged)) / len(outputs),
            "mean_first_divergence": sum(diverged) / len(diverged) if diverged else None,
            "first_divergences": diverged}


def keep_float(model, reference, parts: tuple[str, ...]) -> None:
    """Put float32 weights (shared with ``reference``, read only) back into an int8 ``model``: the
    LM head ("head") and/or every linear layer of its first and last decoder layers ("ends")."""
    if "head" in parts:
        model.lm_head = reference.lm_head
    if "ends" in parts:
        for i in (0, len(model.layers) - 1):
            for name in ("qkv", "o_proj", "gate_up", "down"):
                setattr(model.layers[i], name, getattr(reference.layers[i], name))


def load_engine(model: str, name: str, reference=None):
    """An engine in precision ``name`` as a worker would load it (plus ``keep_float``'s variants)."""
    from shared.engine import EngineConfig, LLMEngine  # noqa: PLC0415

    dtype, quantization, parts, *kv_dtype = PRECISIONS[name]
    engine = LLMEngine.from_config(EngineConfig(model=model, dtype=dtype, quantization=quantization,
                                                kv_cache_memory=64 << 20,
                                                kv_cache_dtype=kv_dtype[0] if kv_dtype else None))
    if parts:
        keep_float(engine.model, reference, parts)
    return engine


class KvDtypeModel:
    """A model whose teacher-forced prefills keep their KV in ``kv_dtype`` (as its engine's pool does)."""
    def __init__(self, model, kv_dtype) -> None:
        self.model, self.kv_dtype = model, kv_dtype

    def prefill_logits(self, token_ids: list[int]):
        return self.model.prefill_logits(token_ids, kv_dtype=self.kv_dtype)


def teacher_forced_model(engine):
    """What ``teacher_forced`` measures of an engine: its model, over a KV of its pool's dtype."""
    if engine.kv_cache.dtype == engine.model.dtype:
        return engine.model
    return KvDtypeModel(engine.model, engine.kv_cache.dtype)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")


def plot(path: Path, report: dict) -> None:
    names = [n for n in report["precisions"] if n != "float32"]
    rows = [report["precisions"][n] for n in names]
    with figure(path, 1, 2, figsize=(10, 4.6)) as (fig, (ax1, ax2)):
        x = range(len(names))
        ax1.bar([i - 0.2 for i in x], [100 * r["teacher_forced"]["top1_agreement"] for r in rows], 0.4,
                label="teacher-forced top-1")
        ax1.bar([i + 0.2 for i in x], [100 * r["greedy"]["equal"] for r in rows], 0.4, label="greedy text equal")
        ax1.axhline(100 * TARGET_TOP1, color="k", ls="--", lw=1, label=f"target {TARGET_TOP1:.0%}")
        ax1.set_ylabel("% agreement with float32")
        ax1.set_ylim(0, 105)
        ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8)
        ax2.bar(list(x), [r["teacher_forced"]["kl"] for r in rows], 0.5)
        ax2.set_ylabel("mean KL(float32 || precision), nats")
        for ax in (ax1, ax2):
            ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
        fig.suptitle(f"{report['model']}: each precision against float32 ({report['corpus_tokens']} tokens, "
                     f"{len(PROMPTS)} prompts)\n{report['cpu']}", fontsize=9)


def print_table(report: dict) -> None:
    print(f"{'precision':<20} {'top-1':>7} {'KL':>9} {'greedy equal':>13} {'first diff':>10}")
    for name, r in report["precisions"].items():
        tf, g = r["teacher_forced"], r["greedy"]
        first = "-" if g["mean_first_divergence"] is None else f"{g['mean_first_divergence']:.1f}"
        print(f"{name:<20} {tf['top1_agreement']:>7.2%} {tf['kl']:>9.5f} {g['equal']:>13.1%} {first:>10}")


def main(argv: list[str] | None = None) -> int:
    import torch  # noqa: PLC0415

    from shared.model.registry import DEFAULT_MODEL  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or path (default: %(default)s)")
    p.add_argument("--precisions", default="float32,bfloat16,float16,int8",
                   help=f"comma-separated, float32 always included (choose from {', '.join(PRECISIONS)})")
    p.add_argument("--tokens", type=int, default=None, help="use the corpus's first N tokens (default: all)")
    p.add_argument("--window", type=int, default=512, help="tokens per teacher-forced prefill")
    p.add_argument("--max-new-tokens", type=int, default=48, help="greedy tokens per prompt")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/quality"))
    args = p.parse_args(argv)
    names = ["float32"] + [n for n in args.precisions.split(",") if n and n != "float32"]
    if unknown := [n for n in names if n not in PRECISIONS]:
        p.error(f"unknown precision {unknown[0]!r} (choose from {', '.join(PRECISIONS)})")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    started = time.perf_counter()
    engines = {"float32": load_engine(args.model, "float32")}
    reference = engines["float32"].model
    for name in names[1:]:
        engines[name] = load_engine(args.model, name, reference)
    tok = engines["float32"].tokenizer
    corpus = tok.encode(CORPUS.read_text())[:args.tokens]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in PROMPTS]

    def progress(done: int, total: int) -> None:
        print(f"teacher-forced: window {done}/{total} ({time.perf_counter() - started:.0f} s)", file=sys.stderr,
              flush=True)

    tf = teacher_forced(reference, {n: teacher_forced_model(e) for n, e in engines.items()}, corpus, args.window,
                        progress)
    answers = {}
    for name, engine in engines.items():
        answers[name] = greedy(engine, prompts, args.max_new_tokens)
        print(f"greedy: {name} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    report = {"model": engines["float32"].model_id, "cpu": cpu_name(), "num_threads": torch.get_num_threads(),
              "corpus": str(CORPUS.relative_to(Path.cwd()) if CORPUS.is_relative_to(Path.cwd()) else CORPUS),
              "corpus_tokens": len(corpus), "window": args.window, "max_new_tokens": args.max_new_tokens,
              "target_top1": TARGET_TOP1, "precisions": {}}
    for name in names:
        dtype, quantization, parts, *_ = PRECISIONS[name]
        report["precisions"][name] = {
            "dtype": dtype, "quantization": quantization, "float32_parts": list(parts),
            "kv_cache_dtype": str(engines[name].kv_cache.dtype).removeprefix("torch."),
            "teacher_forced": tf[name], "greedy": greedy_equality(answers["float32"], answers[name]),
            "sample": tok.decode(answers[name][0])}
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(f"{report['model']} on {report['cpu']}, {report['num_threads']} threads: {len(corpus)} corpus tokens "
          f"in windows of {args.window}, {len(prompts)} prompts x {args.max_new_tokens} greedy tokens")
    print_table(report)
    save_report(args.out, "quality", report, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
