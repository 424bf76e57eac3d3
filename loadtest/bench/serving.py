"""Serving throughput against a peer: 1, 8 and 32 concurrent streams on any OpenAI endpoints.

    python -m loadtest.bench.serving --target tandem=http://127.0.0.1:8000 --target llama=http://127.0.0.1:8090
    python -m loadtest.bench.serving --start-tandem --start-llama   # starts both here, then measures
    python -m loadtest.bench.serving --start-tandem-as "spec=--speculative-tokens 6" --start-tandem-as "off="
                                     # two Tandem stacks with different flags, the last the baseline
    python -m loadtest.bench.serving --start-tandem --start-llama --model /tmp/llama-1b-q8_0.gguf
                                     # both serve the same GGUF file (tools.synth_model writes one)
    python -m loadtest.bench.serving --start-tandem --start-llama --start-vllm
                                     # vLLM's CPU backend too, on the GGUF's weights in bf16
                                     # (loadtest/tools/vllm_server.py; its venv made on first use)

Every request: a prompt of ``--prompt-tokens`` tokens (the model's own tokenizer), ``--output-tokens``
greedy tokens with ``ignore_eos``, streamed. At concurrency c the targets take turns, one wave of c
simultaneous streams each, ``--rounds`` times, so that a change in the machine's load hits every
target alike. Before each wave the bench waits (``--settle-s`` at most) until the machine's CPUs are
nearly idle: a server can keep working after its last response (vLLM's engine keeps about one core
busy for a second or more), and the target whose turn comes next would pay for it. Reports aggregate
output tokens/s (tokens of a wave / the wave's wall time), prompt tokens/s over the same time, and
inter-token latency; writes ``serving.json`` and ``serving.png`` under ``--out`` and prints each
target's ratio to the first one. Each wave also records the hypervisor's share of the machine's CPU
(``round_cpu_steal_share``; ``loadtest/tools/cpu_steal.py``): on a shared virtual machine a round with
much steal is slower for whoever ran in it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import subprocess
import time
from pathlib import Path

from loadtest.tools.cpu_steal import busy_share, cpu_times, steal_share
from loadtest.tools.runner import run_openai
from loadtest.tools.tandem_server import tandem_up
from loadtest.tools.workload import RequestSpec
from services.stack.servers import free_port
from shared.telemetry.measure import percentile
from shared.telemetry.plot import figure


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str):
    """The model's tokenizer, built once per model (a GGUF's takes a second or more to read)."""
    from shared.model.registry import resolve_model
    from shared.tokenizer import Tokenizer

    source = resolve_model(model)
    return Tokenizer.from_model_files(source.path, source.format)


def prompt_of_tokens(model: str, num_tokens: int, salt: int) -> str:
    """A text that the model's tokenizer reads as ``num_tokens`` tokens; ``salt`` makes it unique
    so that no target serves it from a prefix cache."""
    tok = _tokenizer(model)
    words = f"Request {salt}. " + " ".join(f"The {w} of the harbour was logged at {salt + i} in the keeper's notebook."
                                         for i, w in enumerate(["wind", "tide", "height", "colour"] * 40))
    ids = tok.encode(words)[:num_tokens]
    return tok.decode(ids)


# a wave starts once the machine's CPUs were busy less than this share of a SETTLE_WINDOW_S window
SETTLE_BUSY = 0.1
SETTLE_WINDOW_S = 0.5


async def settle(max_s: float) -> float:
    """Wait until the machine is nearly idle (``SETTLE_BUSY``), ``max_s`` at most (0: not at all);
    returns the seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_s:
        before = cpu_times()
        await asyncio.sleep(SETTLE_WINDOW_S)
        share = busy_share(before, cpu_times())
        if share is None or share < SETTLE_BUSY:
            break
    return time.perf_counter() - t0


async def _wave(url: str, model: str, prompts: list[str], output_tokens: int, settle_s: float = 0.0) -> dict:
    specs = [RequestSpec(i, 0.0, p, output_tokens) for i, p in enumerate(prompts)]
    settled = await settle(settle_s)
    t0, cpu0 = time.perf_counter(), cpu_times()
    results = await run_openai(url, model, specs, progress=False, ignore_eos=True)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "cpu_steal_share": steal_share(cpu0, cpu_times()), "settle_s": round(settled, 2),
            "tokens": sum(r.num_output_tokens for r in results),
            # the prompt tokens the target counted (usage), and those it served from a prefix cache
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in results),
            "cached_tokens": sum(r.cached_tokens or 0 for r in results),
            "itls_s": [x for r in results for x in r.itls_s()],
            "ttfts_s": [r.ttft_s for r in results if r.ttft_s is not None],
            "tpots_s": [r.tpot_s for r in results if r.tpot_s is not None],
            "errors": [r.error for r in results if r.error]}


def _steal_note(wave: dict) -> str:
    share = wave.get("cpu_steal_share")
    return "" if share is None else f" ({share:.0%} CPU steal)"


def summarize_waves(waves: list[dict]) -> dict:
    wall = sum(w["wall_s"] for w in waves)
    tokens = sum(w["tokens"] for w in waves)
    prompt_tokens = sum(w.get("prompt_tokens", 0) for w in waves)
    itls = [x for w in waves for x in w["itls_s"]]
    ttfts = [x for w in waves for x in w["ttfts_s"]]
    tpots = [x for w in waves for x in w["tpots_s"]]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 2)

    return {"output_tok_s": round(tokens / wall, 1) if wall else None, "output_tokens": tokens,
            # prompt tokens over the same wall time: with --output-tokens 1 a wave is its prefills
            "prompt_tok_s": round(prompt_tokens / wall, 1) if wall else None, "prompt_tokens": prompt_tokens,
            "cached_tokens": sum(w.get("cached_tokens", 0) for w in waves),
            # each round's own figure, in order: how far the machine's load moved them
            "round_tok_s": [round(w["tokens"] / w["wall_s"], 1) if w["wall_s"] else None for w in waves],
            # and the hypervisor's share of the machine's CPU time during each (cpu_steal.py)
            "round_cpu_steal_share": [None if (x := w.get("cpu_steal_share")) is None else round(x, 3) for w in waves],
            # how long each waited for the machine to be idle before it started (settle)
            "round_settle_s": [w.get("settle_s") for w in waves],
            "itl_p50_ms": ms(percentile(itls, 50)), "itl_p90_ms": ms(percentile(itls, 90)),
            # per-request mean time per output token: unlike the ITL of text chunks, not fooled by
            # chunks that arrive together in one read
            "tpot_p50_ms": ms(percentile(tpots, 50)), "ttft_p50_ms": ms(percentile(ttfts, 50)),
            "errors": [e for w in waves for e in w["errors"]][:5]}


async def measure(targets: dict[str, str], model: str, concurrency: list[int], rounds: int,
                  prompt_tokens: int, output_tokens: int, settle_s: float = 0.0) -> dict[str, dict[int, dict]]:
    """``model``: an alias or a model file, named in requests as given (``tandem up --model``'s name).
    ``settle_s``: the longest wait for an idle machine before each wave (``settle``)."""
    waves: dict[str, dict[int, list]] = {name: {c: [] for c in concurrency} for name in targets}
    # unique per run, so that a server measured again serves no prompt from its prefix cache
    salt = time.time_ns() // 1000 % 10**9 * 1000
    for name, url in targets.items():  # warm-up: first-request costs stay out of the figures
        await _wave(url, model, [prompt_of_tokens(model, prompt_tokens, salt := salt + 1)], 8)
    for c in concurrency:
        for _ in range(rounds):
            for name, url in targets.items():
                prompts = [prompt_of_tokens(model, prompt_tokens, salt := salt + 1) for _ in range(c)]
                waves[name][c].append(await _wave(url, model, prompts, output_tokens, settle_s))
            print(f"c={c}, round {len(waves[next(iter(targets))][c])}: " + ", ".join(
                f"{n} {summarize_waves(waves[n][c][-1:])['output_tok_s']} tok/s{_steal_note(waves[n][c][-1])}"
                for n in targets), flush=True)
    return {name: {c: summarize_waves(w) for c, w in per_c.items()} for name, per_c in waves.items()}


def ratios(results: dict[str, dict[int, dict]], key: str = "output_tok_s") -> dict[str, dict[int, float]]:
    """Each target's ``key`` (output tokens/s) over the last target's (the peer), per concurrency."""
    names = list(results)
    peer = results[names[-1]]
    return {n: {c: round(r[key] / peer[c][key], 2) for c, r in results[n].items() if r.get(key) and peer[c].get(key)}
            for n in names[:-1]}


def plot(results: dict[str, dict[int, dict]], path: Path) -> None:
    with figure(path, 1, 2, figsize=(10, 4)) as (fig, (a, b)):
        for name, per_c in results.items():
            cs = sorted(per_c)
            a.plot(cs, [per_c[c]["output_tok_s"] for c in cs], marker="o", label=name)
            b.plot(cs, [per_c[c]["itl_p50_ms"] for c in cs], marker="o", label=name)
        for ax, title in ((a, "aggregate output tokens/s"), (b, "inter-token latency p50 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams")
            ax.set_title(title)
            ax.legend()


@contextlib.contextmanager
def llama_server(threads: int, parallel: int, model: str):
    from loadtest.tools import llama_server as ls
    from shared.model.registry import resolve_model

    port = free_port()
    proc = ls.start(port, parallel=parallel, threads=threads, gguf=resolve_model(model).path)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@contextlib.contextmanager
def vllm_server(model: str, cpus: str | None, max_num_seqs: int, out: Path):
    from loadtest.tools import vllm_server as vs

    port = free_port()
    out.mkdir(parents=True, exist_ok=True)
    proc = vs.start(port, model, cpus, max_num_seqs=max_num_seqs, log=out / "vllm.log")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def print_report(report: dict) -> None:
    results = report["results"]
    for name, per_c in results.items():
        for c, r in per_c.items():
            print(f"{name:14s} c={c:<3d} {r['output_tok_s']} tok/s  prompt {r['prompt_tok_s']} tok/s  "
                  f"ITL p50 {r['itl_p50_ms']} ms  TPOT p50 {r['tpot_p50_ms']} ms  TTFT p50 {r['ttft_p50_ms']} ms  "
                  f"cached prompt tokens {r['cached_tokens']}  errors {len(r['errors'])}")
    for label, key in (("output", "ratios_to_peer"), ("prompt", "prompt_ratios_to_peer")):
        for name, per_c in report[key].items():
            print(f"{label} {name} / {list(results)[-1]}: " + ", ".join(f"c={c}: {x}x" for c, x in per_c.items()))
    print(f"load average before {report['machine']['loadavg_before']}, after {report['machine']['loadavg_after']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", default=[], help="name=base_url; the last one is the peer")
    p.add_argument("--start-tandem", action="store_true", help="start `tandem up` here as target 'tandem'")
    p.add_argument("--tandem-args", default="", help="extra flags for tandem up, e.g. '--dtype float32'")
    p.add_argument("--start-tandem-as", action="append", default=[], metavar="NAME=FLAGS",
                   help="start `tandem up FLAGS` here as target NAME (repeatable; after --start-tandem's, "
                        "before --target's and llama-server)")
    p.add_argument("--start-llama", action="store_true", help="start llama-server here as target 'llama-server'")
    p.add_argument("--start-vllm", action="store_true",
                   help="start vLLM's CPU backend here as target 'vllm', on the model's GGUF dequantized to a bf16 "
                        "directory (loadtest.tools.vllm_server: its own venv, made on first use)")
    p.add_argument("--vllm-cpus", default=None, help="cores for vLLM's threads, e.g. 0-1 (default: every core)")
    p.add_argument("--threads", type=int, default=2, help="llama-server threads")
    p.add_argument("--model", default="smollm2-135m",
                   help="an alias or a .gguf file; started targets serve it (tandem up --model, llama-server -m)")
    p.add_argument("--ready-timeout", type=float, default=900.0,
                   help="seconds a started tandem may take to be ready and compiled (a 1B model compiles longer)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--settle-s", type=float, default=10.0,
                   help="before each wave, wait up to this long for the machine's CPUs to be nearly idle (0: no wait)")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/serving"))
    args = p.parse_args(argv)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    with contextlib.ExitStack() as stack:
        targets = dict(t.split("=", 1) for t in args.target)
        started = dict(t.split("=", 1) for t in args.start_tandem_as)
        if args.start_tandem:
            started = {"tandem": args.tandem_args, **started}
        model_flags = ["--model", args.model]
        targets = {**{name: stack.enter_context(tandem_up(model_flags + flags.split(), args.ready_timeout, name))
                      for name, flags in started.items()},
                   **targets}
        if args.start_llama:
            targets["llama-server"] = stack.enter_context(llama_server(args.threads, max(concurrency), args.model))
        if args.start_vllm:
            targets["vllm"] = stack.enter_context(vllm_server(args.model, args.vllm_cpus, max(concurrency), args.out))
        if not targets:
            p.error("give --target name=url or --start-tandem / --start-tandem-as / --start-llama / --start-vllm")
        load_before = os.getloadavg()
        results = asyncio.run(measure(targets, args.model, concurrency, args.rounds, args.prompt_tokens,
                                      args.output_tokens, args.settle_s))
    report = {"config": {k: str(v) for k, v in vars(args).items()}, "targets": targets,
              "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
              "results": results, "ratios_to_peer": ratios(results) if len(results) > 1 else {},
              "prompt_ratios_to_peer": ratios(results, "prompt_tok_s") if len(results) > 1 else {}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps(report, indent=2))
    plot(results, args.out / "serving.png")
    print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
