"""Where a decode step's time goes: torch's profiler over engine steps at a few batch sizes.

    python -m loadtest.tools.profile_step [--batch-sizes 1,8,32] [--steps 30] [--dtype float32]

One engine in process (default precision unless --dtype/--quantization), ``B`` greedy requests
with 128-token prompts, stepped until all of them decode. Then ``--steps`` decode steps are timed
plainly (the step time reported), and as many again under ``torch.profiler`` to split them: the
ops' own CPU time by kind (matmuls, attention, the rest) and the time outside any op (Python:
scheduling, the runner's bookkeeping, sampling logic, and torch's per-op dispatch). The shares come
from the profiled steps and are applied to the plain step time, since the profiler slows each op
call. Also counted: aten op calls per step (calls made inside other ops included), the number
that makes per-op overhead add up, and the ten ops with the most time of their own. Writes
``profile_step.json`` and ``profile_step.png`` under --out.

With ``--prompts 8x128,2x1000`` it splits prompt steps instead: for each ``N``x``L``, N prompts of L
tokens (each its own tokens, so none is a prefix-cache hit) prefilled to their first token, once
plainly (prompt tokens/s reported) and once under the profiler, split the same way.

With ``--compile --kernel-profile`` the engine runs the compiled decode step and inductor records
each of its C++ loops: the split is then matmuls (called from the graph), the fused loops, and the
rest (the graph's caller, dynamo's guard check, and the Python around the graph).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from shared.model.precision import QUANTIZATION_METHODS
from shared.telemetry.plot import figure

# exact aten op names, and name prefixes of op families (the SDPA kernels, oneDNN and packed-weight
# matmuls), per kind; anything else is "other ops"
KINDS = {
    "matmul": ({"mm", "addmm", "bmm", "matmul", "linear", "_int_mm", "baddbmm", "panel_mm", "block_mm", "int8_mm"},
               ("_weight_int8pack_mm", "_weight_int4pack_mm", "mkldnn_", "onednn", "qlinear")),
    "attention": ({"scaled_dot_product_attention", "softmax", "_softmax", "flex_attention", "decode_attention",
                    "prefill_attention"},
                  ("_scaled_dot_product",)),
}
# our C++ ops (kernels/cpu/*.cpp) are recorded under their own namespaces, beside aten's
OP_NAMESPACES = ("aten::", "aoti_torch_cpu_", "tandem_blocks::", "tandem_attn::", "tandem_prefill_attn::",
                 "tandem_cpu::")
# with --compile the graph's C++ caller reaches aten through shims (aoti_torch_cpu_<op>_out), and its
# own loops are recorded under their kernel names (graph_<n>_cpp_fused_...) when inductor's kernel
# profile is on; everything else inside the graph is the caller itself
COMPILED_LOOPS = "fused loops (compiled)"


def kind_of(op_name: str) -> str:
    if "_cpp_fused_" in op_name:
        return COMPILED_LOOPS
    name = op_name.split("::")[-1].removeprefix("aoti_torch_cpu_").removesuffix("_out")
    for kind, (names, prefixes) in KINDS.items():
        if name in names or name.startswith(prefixes):
            return kind
    return "other ops"


def decoding_engine(args, batch_size: int, compile: bool = False):
    from shared.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: PLC0415

    engine = LLMEngine.from_config(EngineConfig(model=args.model, device="cpu", dtype=args.dtype,
                                                quantization=args.quantization, num_threads=args.num_threads,
                                                kv_cache_memory=512 << 20, max_num_seqs=max(batch_size, 1),
                                                compile=compile))
    for i in range(batch_size):
        prompt = synthetic_prompt(engine, i, args.prompt_tokens, stride=17)
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
    while engine.stats().num_running < batch_size or any_prefilling(engine):
        engine.step()
    for _ in range(3):  # warm
        engine.step()
    return engine


def synthetic_prompt(engine, i: int, length: int, stride: int) -> list[int]:
    """Prompt ``i``'s ``length`` token ids, inside the model's vocabulary; ``stride`` sets how far apart
    two prompts' first tokens are (a prime as large as 7919 keeps every prompt's first block its own)."""
    vocab = engine.model.config.vocab_size if hasattr(engine.model, "config") else 32000
    return [(stride * i + 31 * j) % (vocab - 10) + 5 for j in range(length)]


def add_decoding_args(p: argparse.ArgumentParser, steps_help: str = "timed steps") -> None:
    """The flags of ``decoding_engine``'s engines and of the batch sizes and steps to time."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default=None, help="engine dtype (default: the device's fastest)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=30, help=steps_help)


def any_prefilling(engine) -> bool:
    return any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
        bool(engine.scheduler.waiting)


def profile(engine, steps: int) -> dict:
    import torch  # noqa: PLC0415

    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    plain_ms = (time.perf_counter() - started) / steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled_ms = (time.perf_counter() - started) / steps * 1e3
    return {"step_ms": plain_ms, "profiled_step_ms": profiled_ms, **split(prof, steps, plain_ms, profiled_ms)}


def run_prompts(engine, num: int, length: int, first: int) -> float:
    """Seconds to prefill ``num`` prompts of ``length`` tokens to their first token; prompt ``first + i``
    starts with tokens of its own, so that no prompt is a prefix-cache hit of another run's."""
    from shared.engine import SamplingParams  # noqa: PLC0415

    for i in range(first, first + num):
        prompt = synthetic_prompt(engine, i, length, stride=7919)
        engine.add_request(f"prompt{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    while engine.scheduler.has_unfinished:
        engine.step()
    return time.perf_counter() - started


def profile_prompts(engine, num: int, length: int, first: int) -> dict:
    """``num`` x ``length`` prompt tokens timed plainly, then again (other prompts) under the profiler."""
    import torch  # noqa: PLC0415

    plain_s = run_prompts(engine, num, length, first)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled_s = run_prompts(engine, num, length, first + num)
    return {"seconds": plain_s, "prompt_tok_s": num * length / plain_s, "profiled_seconds": profiled_s,
            **split(prof, 1, plain_s * 1e3, profiled_s * 1e3)}


def split(prof, steps: int, plain_ms: float, profiled_ms: float) -> dict:
    """A profile of ``steps`` steps (or runs) of ``profiled_ms`` each, by op kind: shares, and those
    shares of ``plain_ms`` (the profiler slows each op call), op calls per step and the ten costliest ops."""
    by_kind: dict[str, float] = {}
    calls = 0
    # aten ops, and the compiled graph's shims and loops; profiler-internal and user ranges are left
    # out (their time is in the ops below them, or outside any op)
    events = [e for e in prof.key_averages()
              if e.key.startswith(OP_NAMESPACES) or "_cpp_fused_" in e.key]
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
    for event in events:
        by_kind[kind_of(event.key)] = by_kind.get(kind_of(event.key), 0.0) + event.self_cpu_time_total / 1e3
        calls += event.count
    in_ops = sum(by_kind.values()) / steps
    shares = {k: v / steps / profiled_ms for k, v in by_kind.items()}
    shares["outside ops (Python, dispatch)"] = max(0.0, 1 - in_ops / profiled_ms)
    return {"op_calls_per_step": calls / steps, "shares": shares,
            "ms": {k: share * plain_ms for k, share in shares.items()},
            "top_ops": [{"op": e.key, "calls_per_step": e.count / steps,
                         "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps} for e in top]}


def plot(path: Path, report: dict) -> None:
    sizes = list(report["batches"])
    kinds = list(dict.fromkeys(k for b in report["batches"].values() for k in b["ms"]))
    with figure(path, figsize=(7, 4.5)) as (fig, ax):
        bottom = [0.0] * len(sizes)
        for kind in kinds:
            values = [report["batches"][b]["ms"].get(kind, 0.0) for b in sizes]
            ax.bar(range(len(sizes)), values, 0.6, bottom=bottom, label=kind)
            bottom = [a + b for a, b in zip(bottom, values)]
        ax.set_xticks(range(len(sizes)), [f"batch {b}" for b in sizes])
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"decode step split ({report['precision']}, {report['num_threads']} threads)")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)


def main(argv: list[str] | None = None) -> int:
    import torch  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decoding_args(p)
    p.add_argument("--compile", action="store_true", help="decode steps as one compiled graph (--compile on)")
    p.add_argument("--kernel-profile", action="store_true",
                   help="with --compile: record each of inductor's loops (its kernel profile; a compile of its own)")
    p.add_argument("--prompts", default=None, metavar="NxL,...",
                   help="split prompt steps instead: N prompts of L tokens each, e.g. 8x128,2x1000")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/profile_step"))
    args = p.parse_args(argv)
    if args.prompts:
        return prompts_main(args)
    if args.kernel_profile:
        import torch._inductor.config  # noqa: PLC0415

        torch._inductor.config.cpp.enable_kernel_profile = True
    report: dict = {"batches": {}}
    for b in (int(x) for x in args.batch_sizes.split(",")):
        engine = decoding_engine(args, b, args.compile)
        report["precision"] = f"{engine.config.dtype}/{engine.config.quantization}"
        report["num_threads"] = torch.get_num_threads()
        r = report["batches"][str(b)] = profile(engine, args.steps)
        print(f"batch {b}: {r['step_ms']:.1f} ms per step ({r['op_calls_per_step']:.0f} aten op calls); "
              + ", ".join(f"{k} {v:.1f} ms ({100 * r['shares'][k]:.0f}%)" for k, v in r["ms"].items()), flush=True)
        del engine
    report["config"] = {k: str(v) for k, v in vars(args).items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_step.json").write_text(json.dumps(report, indent=1))
    plot(args.out / "profile_step.png", report)
    print("wrote", args.out / "profile_step.json", args.out / "profile_step.png")
    return 0


def prompts_main(args) -> int:
    """``--prompts``: each NxL's prompt tokens/s and op split, written to ``profile_prompts.json``."""
    import torch  # noqa: PLC0415

    from shared.engine import EngineConfig, LLMEngine  # noqa: PLC0415

    engine = LLMEngine.from_config(EngineConfig(model=args.model, device="cpu", dtype=args.dtype,
                                                quantization=args.quantization, num_threads=args.num_threads,
                                                kv_cache_memory=512 << 20))
    report: dict = {"precision": f"{engine.config.dtype}/{engine.config.quantization}",
                    "num_threads": torch.get_num_threads(), "prompts": {}}
    run_prompts(engine, 2, 128, 0)  # warm
    first = 100
    for spec in args.prompts.split(","):
        num, length = (int(x) for x in spec.lower().split("x"))
        r = report["prompts"][spec] = profile_prompts(engine, num, length, first)
        first += 2 * num
        print(f"{num} x {length} prompt tokens: {r['seconds']:.2f} s ({r['prompt_tok_s']:.0f} tok/s); "
              + ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["shares"].items()), flush=True)
    report["config"] = {k: str(v) for k, v in vars(args).items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_prompts.json").write_text(json.dumps(report, indent=1))
    print("wrote", args.out / "profile_prompts.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
