"""Where a served token's time goes: the same decode step in process and behind ``tandem up``.

    python -m loadtest.bench.serving_split [--concurrency 1,8] [--tandem-args "--compile off"]

First ``tandem up`` (one decode worker, its defaults plus --tandem-args) serves ``c`` concurrent
greedy streams (128-token prompts, --output-tokens each, ``ignore_eos``), two waves per
concurrency. Read per concurrency:

- the client's inter-token latency (p50 and mean): what a user sees per token;
- the worker's own inter-token time and its engine step time (means, from its Prometheus metrics;
  the step mean includes the waves' few prefill steps);
- each process's CPU time per output token (from /proc), and its share of a core over the waves.

Then, the baseline in the same run: one engine in this process with the same precision, ``c``
requests decoding over the same contexts (the prompt's length to prompt + output tokens), its mean
plain step time (``loadtest.tools.profile_step``'s engine). The ratio client ITL mean / in-process step
says what serving adds to a token: the bus, the gateway and the client, and the other processes'
share of the cores under the engine's threads. Writes ``serving_split.json``
and ``serving_split.png`` under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import time
import urllib.request
from pathlib import Path

from loadtest.bench.serving import _wave, prompt_of_tokens
from loadtest.tools.harness import status
from loadtest.tools.tandem_server import tandem_up
from shared.telemetry.measure import percentile

METRICS = ("tandem_engine_step_seconds_sum", "tandem_engine_step_seconds_count",
           "tandem_worker_itl_seconds_sum", "tandem_worker_itl_seconds_count")


def scrape(url: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in METRICS:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def process_tree(pid: int) -> list[int]:
    pids, todo = [pid], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(k) for k in open(f"/proc/{p}/task/{p}/children").read().split()]
        except OSError:
            kids = []
        pids += kids
        todo += kids
    return pids


def _stat_cpu_seconds(stat_path: str) -> float:
    """User + system CPU seconds from a /proc ``stat`` file (a process's: all its threads)."""
    fields = open(stat_path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> dict[int, tuple[str, float]]:
    """pid -> (what it runs, user + system CPU seconds of all its threads)."""
    found = {}
    for pid in pids:
        try:
            seconds = _stat_cpu_seconds(f"/proc/{pid}/stat")
            argv = open(f"/proc/{pid}/cmdline").read().split("\0")
        except OSError:
            continue
        name = os.path.basename(argv[0])
        if "services.cli" in argv:  # python -m services.cli <service> ...
            name = argv[argv.index("services.cli") + 1]
        found[pid] = (name, seconds)
    return found


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """A process's CPU seconds by thread name (threads of one name summed: OpenMP's team)."""
    found: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            seconds = _stat_cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
        except OSError:
            continue
        name = "main (event loop)" if tid == str(pid) else name
        found[name] = found.get(name, 0.0) + seconds
    return found


def served(args, concurrency: list[int]) -> dict[int, dict]:
    results: dict[int, dict] = {}
    with tandem_up(shlex.split(args.tandem_args)) as url:
        page = status(url)
        worker = next(s for s in page["services"] if s["service"] == "decode")
        metrics_url, worker_pid = worker["metrics_url"], worker["pid"]
        asyncio.run(_wave(url, args.model, [prompt_of_tokens(args.model, args.prompt_tokens, 0)], 8))
        salt = 1
        for c in concurrency:
            waves_prompts = []
            for _ in range(2):
                waves_prompts.append([prompt_of_tokens(args.model, args.prompt_tokens, salt + i) for i in range(c)])
                salt += c
            pids = process_tree(os.getpid())[1:]  # tandem up and everything it started
            before, cpu_before, threads_before = scrape(metrics_url), cpu_seconds(pids), thread_cpu_seconds(worker_pid)
            waves = [asyncio.run(_wave(url, args.model, prompts, args.output_tokens)) for prompts in waves_prompts]
            after, cpu_after, threads_after = scrape(metrics_url), cpu_seconds(pids), thread_cpu_seconds(worker_pid)
            wall = sum(w["wall_s"] for w in waves)
            tokens = sum(w["tokens"] for w in waves)
            itls = [x for w in waves for x in w["itls_s"]]

            def mean_of(name: str) -> float:
                return (after[f"{name}_sum"] - before[f"{name}_sum"]) / (after[f"{name}_count"] - before[f"{name}_count"])

            cpu = {}
            for pid, (name, seconds) in cpu_after.items():
                spent = seconds - cpu_before.get(pid, (name, 0.0))[1]
                key = name if name not in cpu else f"{name}-{pid}"
                cpu[key] = {"ms_per_token": spent / tokens * 1e3, "core_share": spent / wall}
            results[c] = {"output_tok_s": tokens / wall, "client_itl_p50_ms": percentile(itls, 50) * 1e3,
                          "client_itl_mean_ms": sum(itls) / len(itls) * 1e3,
                          "worker_itl_mean_ms": mean_of("tandem_worker_itl_seconds") * 1e3,
                          "worker_step_mean_ms": mean_of("tandem_engine_step_seconds") * 1e3,
                          "errors": [e for w in waves for e in w["errors"]][:5],
                          "cpu": dict(sorted(cpu.items(), key=lambda kv: -kv[1]["ms_per_token"])),
                          "decode_threads_ms_per_token": {
                              name: (seconds - threads_before.get(name, 0.0)) / tokens * 1e3
                              for name, seconds in sorted(threads_after.items(), key=lambda kv: -kv[1])}}
    return results


def steady_compile_mode(tandem_args: str) -> str:
    """The step the served workers settle on: compiled unless ``--compile off`` is among the flags
    (a worker compiles in the background by default; here the engine compiles before it is timed)."""
    flags = shlex.split(tandem_args)
    given = flags[flags.index("--compile") + 1] if "--compile" in flags[:-1] else "background"
    return "off" if given == "off" else "on"


def in_process(args, concurrency: list[int]) -> dict[int, float]:
    """The plain decode step time (ms) of one engine in this process at each batch size."""
    from loadtest.tools.profile_step import decoding_engine  # noqa: PLC0415

    ns = argparse.Namespace(model=args.model, dtype=None, quantization=None, num_threads=None,
                            prompt_tokens=args.prompt_tokens)
    steps = {}
    for c in concurrency:
        engine = decoding_engine(ns, c, compile=steady_compile_mode(args.tandem_args))
        # the served requests' decode steps run from context prompt + 1 to prompt + output tokens:
        # step over the same contexts (attention and the KV gather grow with them); 4 are done
        num_steps = args.output_tokens - 4
        started = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        steps[c] = (time.perf_counter() - started) / num_steps * 1e3
        del engine
    return steps


def main(argv: list[str] | None = None) -> int:
    from loadtest.tools.report import bar_chart  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--tandem-args", default="", help="extra flags for tandem up, e.g. '--compile off'")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/serving_split"))
    args = p.parse_args(argv)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    serve = served(args, concurrency)
    alone = in_process(args, concurrency)
    report = {"config": vars(args) | {"out": str(args.out)}, "cpus": os.cpu_count(), "concurrency": {}}
    for c in concurrency:
        r = report["concurrency"][str(c)] = serve[c] | {"in_process_step_ms": alone[c]}
        r["served_over_in_process"] = r["client_itl_mean_ms"] / alone[c]
        print(f"c={c}: in process {alone[c]:.2f} ms per step; served: worker step {r['worker_step_mean_ms']:.2f} ms, "
              f"worker ITL {r['worker_itl_mean_ms']:.2f} ms, client ITL mean {r['client_itl_mean_ms']:.2f} ms "
              f"({r['served_over_in_process']:.2f}x in process), {r['output_tok_s']:.1f} tok/s")
        for name, use in r["cpu"].items():
            if use["core_share"] >= 0.005:
                print(f"    {name:<14} {use['ms_per_token']:7.2f} ms CPU per output token, {use['core_share']:6.1%} of a core")
        print("    decode worker by thread, ms CPU per output token: " + ", ".join(
            f"{name} {ms:.2f}" for name, ms in r["decode_threads_ms_per_token"].items() if ms >= 0.01))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving_split.json").write_text(json.dumps(report, indent=1))
    cs = [str(c) for c in concurrency]
    bar_chart(args.out / "serving_split.png", [f"c={c}" for c in cs],
              {"in-process step": [report["concurrency"][c]["in_process_step_ms"] for c in cs],
               "worker step (mean)": [report["concurrency"][c]["worker_step_mean_ms"] for c in cs],
               "client ITL (mean)": [report["concurrency"][c]["client_itl_mean_ms"] for c in cs]},
              ylabel="ms per token", title="a decode step in process and served")
    print("wrote", args.out / "serving_split.json", args.out / "serving_split.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
