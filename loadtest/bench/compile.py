"""The compiled decode step against the eager one, in one run.

    python -m loadtest.bench.compile [--batch-sizes 1,8,32] [--steps 30] [--rounds 3]

For each batch size, two engines on the same model and precision (default: the device's, float32 +
int8 layers here), one eager and one with ``--compile`` (shared/engine/compiled/step.py), each with ``B``
greedy requests of 128-token prompts stepped until all of them decode. Then the engines take turns,
``--steps`` timed decode steps each per round, so that a change in the machine's load hits both.
Reports each engine's median ms per step, the speed-up (eager time / compiled time), whether the
two engines' greedy tokens agree after the run, and the compile time (warm-up of the graphs, which
inductor's on-disk cache shortens after the first run). Writes ``compile.json`` and ``compile.png``
under --out.

    python -m loadtest.bench.compile --during-compile [--nice 0,19] [--where process,thread] [--batch-sizes 1]

What serving pays while a worker compiles (``--compile background``, the default): for each nice
value of the compile (``TANDEM_COMPILE_NICE``) and each place it runs (``--where``: a child process
of the worker, or its compile thread; ``TANDEM_COMPILE_PROCESS``), a fresh process with an empty
inductor cache times an eager engine's decode steps alone, then builds an engine that compiles in
the background and times every decode step until the compiled step takes over (or
``--max-during-s`` has passed). Both caches are cold: inductor's and this machine's compiled steps.
A step's time grows with its context, so each request restarts (same prompt) after
``--cycle-tokens`` output tokens, alone and during the compile: both are timed over the same
contexts (before, the steps during a minutes-long compile ran at contexts thousands of tokens
longer than the steps alone they were compared with). Reports the median, p90, p99 and mean step
time during the compile (a stall of the engine thread shows in the mean and the tail, not the
median), the median over the eager median alone, the mean over the eager mean, and how long the
compile took. Writes ``during_compile.json`` under --out.

    python -m loadtest.bench.compile --artifacts [--model smollm2-135m]

What a worker on a fresh machine pays to reach the compiled step, with and without the cluster's
artifacts (shared/engine/compiled/artifacts.py). A nats-server of its own, then three runs of
``tandem model fetch --compile --nats`` (load the model, load or compile the step as a worker
would), each a fresh process: ``cold`` with an empty compile cache and nothing in the cluster (it
compiles and publishes); ``cluster`` with another empty cache, fetching the first run's artifacts
and loading them; ``local`` again on the second cache. Reports each run's wall time (process start
to a step ready to serve), how long the step took to compile or load, and the two ratios to
``cold``. ``--keep`` also installs the cold run's artifacts in this machine's compile cache.
Writes ``artifacts.json`` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from loadtest.tools.harness import take_turns
from loadtest.tools.report import save_report
from shared.engine.compiled.child import use_child_process
from loadtest.tools.profile_step import add_decoding_args, any_prefilling, decoding_engine
from shared.telemetry.measure import percentile
from shared.telemetry.plot import figure


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
    times = take_turns({"eager": lambda _: timed_steps(eager, args.steps),
                        "compiled": lambda _: timed_steps(compiled, args.steps)}, args.rounds)
    a, b = outputs(eager), outputs(compiled)
    same = sum(a[k] == b.get(k) for k in a)
    eager_ms, compiled_ms = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {"eager_ms": round(eager_ms, 2), "compiled_ms": round(compiled_ms, 2),
            "speedup": round(eager_ms / compiled_ms, 2), "rounds_ms": {k: [round(x, 2) for x in v] for k, v in times.items()},
            "requests_with_equal_tokens": same, "num_requests": len(a),
            "compiled_engine_build_s": round(build_s, 1), "compiled_steps": compiled.runner.compiled.num_steps,
            "precision": f"{eager.config.dtype}/{eager.config.quantization}"}


def recycled_step(engine, cycle: int) -> float:
    """One timed decode step (ms), after restarting (the same prompt, a fresh id) each request that
    has ``cycle`` output tokens, and stepping untimed until the restarts have prefilled. So every
    timed step runs at a context between the prompt and the prompt plus ``cycle`` tokens, whenever
    it is taken: a step's time grows with its context, and steps taken over minutes of a compile
    must not be compared with steps taken in its first seconds."""
    for r in list(engine.scheduler.running):
        if len(r.output_token_ids) >= cycle:
            engine.abort_request(r.request_id)
            engine.add_request(f"{r.request_id.split('.')[0]}.{uuid.uuid4().hex[:6]}", list(r.prompt_token_ids),
                               r.sampling_params)
    while any_prefilling(engine):
        engine.step()
    return timed_steps(engine, 1)


def during_compile(args, batch_size: int) -> dict:
    """In this process (its inductor cache must be cold): eager steps alone, then the steps of an
    engine whose decode step compiles in the background, until it runs compiled. Contexts cycle
    through the same range in both (``recycled_step``)."""
    eager = decoding_engine(args, batch_size)
    alone = [recycled_step(eager, args.cycle_tokens) for _ in range(max(args.steps, 3 * args.cycle_tokens))]
    del eager
    engine = decoding_engine(args, batch_size, compile="background")
    started = time.perf_counter()
    during: list[float] = []
    finished = True
    while engine.decode_step() != "compiled":
        if engine.background_compile.done.is_set() and engine.background_compile.error is not None:
            raise RuntimeError(f"the compile failed: {engine.background_compile.error}")
        during.append(recycled_step(engine, args.cycle_tokens))
        if args.max_during_s is not None and time.perf_counter() - started > args.max_during_s:
            finished = False  # a saturated engine can starve a compile at nice 19: report the steps so far
            break
    compile_s = time.perf_counter() - started
    after = [recycled_step(engine, args.cycle_tokens) for _ in range(args.steps)] if finished else None
    eager_ms = statistics.median(alone)
    return {"eager_alone_ms": round(eager_ms, 2), "eager_alone_mean_ms": round(statistics.fmean(alone), 2),
            "compile_process": use_child_process(),
            "during_compile_p50_ms": round(statistics.median(during), 2),
            "during_compile_p90_ms": round(percentile(during, 90), 2) if len(during) > 1 else None,
            "during_compile_p99_ms": round(percentile(during, 99), 2) if len(during) > 1 else None,
            "during_compile_mean_ms": round(statistics.fmean(during), 2),
            "during_compile_max_ms": round(max(during), 2),
            "during_over_alone_p50": round(statistics.median(during) / eager_ms, 2),
            "during_over_alone_mean": round(statistics.fmean(during) / statistics.fmean(alone), 2),
            "compiled_ms": round(statistics.median(after), 2) if after else None, "steps_during_compile": len(during),
            "compile_finished": finished, "compile_s": round(compile_s, 1) if finished else None,
            "timed_s": round(compile_s, 1), "precision": f"{engine.config.dtype}/{engine.config.quantization}"}


def precision_flags(args) -> list[str]:
    """The child command's --dtype, --quantization and --num-threads, those given here."""
    return [part for flag in ("dtype", "quantization", "num_threads") if getattr(args, flag) is not None
            for part in (f"--{flag.replace('_', '-')}", str(getattr(args, flag)))]


def run_during_compile(args) -> int:
    """One fresh process per nice value, each with an empty inductor cache, taking turns."""
    report: dict = {"batches": {}, "config": {k: str(v) for k, v in vars(args).items()}}
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for nice, where in ((int(n), w) for n in args.nice.split(",") for w in args.where.split(",")):
            with tempfile.TemporaryDirectory(prefix="inductor-cold-") as cache:
                # cold caches both: inductor's, and this machine's compiled steps (else the step is loaded)
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TANDEM_COMPILE_NICE": str(nice),
                       "TANDEM_COMPILE_CACHE_DIR": str(Path(cache) / "tandem"),
                       "TANDEM_COMPILE_PROCESS": "1" if where == "process" else "0"}
                cmd = [sys.executable, "-m", "loadtest.bench.compile", "--one-during-compile", "--batch-sizes", str(b),
                       "--steps", str(args.steps), "--cycle-tokens", str(args.cycle_tokens),
                       "--model", args.model, "--prompt-tokens", str(args.prompt_tokens),
                       *precision_flags(args),
                       *(["--max-during-s", str(args.max_during_s)] if args.max_during_s is not None else [])]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            report["batches"].setdefault(str(b), {})[f"nice {nice}, {where}"] = r
            ended = (f"compile {r['compile_s']} s; compiled {r['compiled_ms']} ms" if r["compile_finished"] else
                     f"the compile had not finished after {r['timed_s']} s (stopped)")
            print(f"batch {b}, compile at nice {nice} in a {where}: eager alone {r['eager_alone_ms']} ms per step "
                  f"(mean {r['eager_alone_mean_ms']}); during the compile p50 {r['during_compile_p50_ms']} ms "
                  f"({r['during_over_alone_p50']}x), p90 {r['during_compile_p90_ms']} ms, p99 "
                  f"{r['during_compile_p99_ms']} ms, mean {r['during_compile_mean_ms']} ms "
                  f"({r['during_over_alone_mean']}x), {r['steps_during_compile']} steps; {ended}", flush=True)
    save_report(args.out, "during_compile", report)
    return 0


def run_artifacts(args) -> int:
    from services.stack.servers import start_nats_server  # noqa: PLC0415

    report: dict = {"runs": {}, "config": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="compile-artifacts-") as tmp:
        nats = start_nats_server(Path(tmp) / "nats")
        try:
            for name, machine in (("cold", "machine-1"), ("cluster", "machine-2"), ("local", "machine-2")):
                cmd = [sys.executable, "-m", "services.cli", "model", "fetch", args.model, "--compile",
                       "--nats", nats.url, "--namespace", "bench", *precision_flags(args)]
                env = {**os.environ, "TANDEM_COMPILE_CACHE_DIR": str(Path(tmp) / machine)}
                started = time.perf_counter()
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                r = {"wall_s": round(time.perf_counter() - started, 1), **json.loads(out.strip().splitlines()[-1])}
                r.pop("dir")
                report["runs"][name] = r
                print(f"{name}: {r['wall_s']} s from process start to the compiled step ({r['step']} in "
                      f"{r['seconds']} s; fetched {r['fetched']}, published {r['published']})", flush=True)
            if args.keep:  # this machine compiled them: later engines here load them
                from shared.engine.compiled.artifacts import CompileArtifacts  # noqa: PLC0415

                cold = report["runs"]["cold"]["key"]
                target = CompileArtifacts.default_root() / cold
                if not target.exists():
                    shutil.copytree(Path(tmp) / "machine-1" / cold, target)
                    print("kept the cold run's artifacts in", target)
        finally:
            nats.stop()
    runs = report["runs"]
    report["ratios"] = {f"{name}_over_cold_wall": round(runs[name]["wall_s"] / runs["cold"]["wall_s"], 3)
                        for name in ("cluster", "local")}
    print("ratios:", report["ratios"])
    save_report(args.out, "artifacts", report)
    return 0


def plot(path: Path, report: dict) -> None:
    sizes = list(report["batches"])
    with figure(path, figsize=(6.5, 4)) as (fig, ax):
        x = range(len(sizes))
        for offset, key in ((-0.2, "eager_ms"), (0.2, "compiled_ms")):
            ax.bar([i + offset for i in x], [report["batches"][b][key] for b in sizes], 0.4,
                   label=key.removesuffix("_ms"))
        for i, b in enumerate(sizes):
            r = report["batches"][b]
            ax.text(i, max(r["eager_ms"], r["compiled_ms"]) * 1.02, f"{r['speedup']}x", ha="center")
        ax.set_xticks(list(x), [f"batch {b}" for b in sizes])
        ax.set_ylabel("ms per decode step (median of rounds)")
        ax.set_title(f"compiled vs eager decode step ({report['precision']})")
        ax.legend()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decoding_args(p, steps_help="timed steps per engine per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("loadtest/results/compile"))
    p.add_argument("--during-compile", action="store_true",
                   help="time decode steps while the decode step compiles in the background (see above)")
    p.add_argument("--nice", default="0,19", help="with --during-compile: the compile thread's nice values")
    p.add_argument("--where", default="process,thread",
                   help="with --during-compile: where the compile runs, process (a child process, the default) "
                        "and/or thread (the worker's own compile thread; TANDEM_COMPILE_PROCESS=0)")
    p.add_argument("--cycle-tokens", type=int, default=128,
                   help="with --during-compile: each request restarts after this many output tokens, so that "
                        "steps alone and during the compile run at the same contexts (at least 3x this many "
                        "steps are timed alone)")
    p.add_argument("--max-during-s", type=float, default=None,
                   help="with --during-compile: stop timing after this many seconds if the compile has not "
                        "finished (a saturated engine can starve a compile at nice 19)")
    p.add_argument("--one-during-compile", action="store_true", help=argparse.SUPPRESS)  # the child process
    p.add_argument("--artifacts", action="store_true",
                   help="time a fresh machine's way to the compiled step: cold, from the cluster, local (see above)")
    p.add_argument("--keep", action="store_true",
                   help="with --artifacts: install the cold run's artifacts in this machine's compile cache")
    args = p.parse_args(argv)
    if args.artifacts:
        return run_artifacts(args)
    if args.one_during_compile:
        print(json.dumps(during_compile(args, int(args.batch_sizes))), flush=True)
        # a compile stopped by --max-during-s is still running (a thread, or a child process): leave
        # without the interpreter's teardown, which can abort under a compiling thread
        os._exit(0)
    if args.during_compile:
        return run_during_compile(args)
    report: dict = {"batches": {}}
    for b in (int(x) for x in args.batch_sizes.split(",")):
        r = report["batches"][str(b)] = measure(args, b)
        report["precision"] = r["precision"]
        print(f"batch {b}: eager {r['eager_ms']} ms, compiled {r['compiled_ms']} ms per step: {r['speedup']}x; "
              f"equal greedy tokens in {r['requests_with_equal_tokens']}/{r['num_requests']} requests; "
              f"compiled engine built in {r['compiled_engine_build_s']} s", flush=True)
    report["config"] = {k: str(v) for k, v in vars(args).items()}
    save_report(args.out, "compile", report, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
