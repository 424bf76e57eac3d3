"""The compiled decode step against the eager one, in one run.

    python -m loadtest.bench_compile [--batch-sizes 1,8,32] [--steps 30] [--rounds 3]

For each batch size, two engines on the same model and precision (default: the device's, float32 +
int8 layers here), one eager and one with ``--compile`` (shared/model/compiled.py), each with ``B``
greedy requests of 128-token prompts stepped until all of them decode. Then the engines take turns,
``--steps`` timed decode steps each per round, so that a change in the machine's load hits both.
Reports each engine's median ms per step, the speed-up (eager time / compiled time), whether the
two engines' greedy tokens agree after the run, and the compile time (warm-up of the graphs, which
inductor's on-disk cache shortens after the first run). Writes ``compile.json`` and ``compile.png``
under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from loadtest.profile_step import add_decoding_args, decoding_engine


def timed_steps(engine, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - started) / steps * 1e3


def outputs(engine) -> dict[str, list[int]]:
    return {r.request_id: list(r.output_token_ids) for r in engine.scheduler.running}


def measure(args, batch_size: int) -> dict:
    eager = decoding_engine(args, batch_size)
    started = time.perf_counter()
    compiled = decoding_engine(args, batch_size, compile=True)
    build_s = time.perf_counter() - started
    # decoding_engine stepped both alike, so the same number of tokens is decoded from here on
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        times["eager"].append(timed_steps(eager, args.steps))
        times["compiled"].append(timed_steps(compiled, args.steps))
    a, b = outputs(eager), outputs(compiled)
    same = sum(a[k] == b.get(k) for k in a)
    eager_ms, compiled_ms = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {"eager_ms": round(eager_ms, 2), "compiled_ms": round(compiled_ms, 2),
            "speedup": round(eager_ms / compiled_ms, 2), "rounds_ms": {k: [round(x, 2) for x in v] for k, v in times.items()},
            "requests_with_equal_tokens": same, "num_requests": len(a),
            "compiled_engine_build_s": round(build_s, 1), "compiled_steps": compiled.runner.compiled.num_steps,
            "precision": f"{eager.config.dtype}/{eager.config.quantization}"}


def plot(path: Path, report: dict) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    sizes = list(report["batches"])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    x = range(len(sizes))
    for offset, key in ((-0.2, "eager_ms"), (0.2, "compiled_ms")):
        ax.bar([i + offset for i in x], [report["batches"][b][key] for b in sizes], 0.4, label=key.removesuffix("_ms"))
    for i, b in enumerate(sizes):
        r = report["batches"][b]
        ax.text(i, max(r["eager_ms"], r["compiled_ms"]) * 1.02, f"{r['speedup']}x", ha="center")
    ax.set_xticks(list(x), [f"batch {b}" for b in sizes])
    ax.set_ylabel("ms per decode step (median of rounds)")
    ax.set_title(f"compiled vs eager decode step ({report['precision']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decoding_args(p, steps_help="timed steps per engine per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("loadtest/results/compile"))
    args = p.parse_args(argv)
    report: dict = {"batches": {}}
    for b in (int(x) for x in args.batch_sizes.split(",")):
        r = report["batches"][str(b)] = measure(args, b)
        report["precision"] = r["precision"]
        print(f"batch {b}: eager {r['eager_ms']} ms, compiled {r['compiled_ms']} ms per step: {r['speedup']}x; "
              f"equal greedy tokens in {r['requests_with_equal_tokens']}/{r['num_requests']} requests; "
              f"compiled engine built in {r['compiled_engine_build_s']} s", flush=True)
    report["config"] = {k: str(v) for k, v in vars(args).items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile.json").write_text(json.dumps(report, indent=1))
    plot(args.out / "compile.png", report)
    print("wrote", args.out / "compile.json", args.out / "compile.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
