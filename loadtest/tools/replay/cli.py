"""The replay's command line: read and scale the slice, run it live or simulated, summarise, write."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from loadtest.tools.harness import SplitSampler, status
from loadtest.tools.replay.live import run_live, start_stack
from loadtest.tools.replay.simulate import run_sim
from loadtest.tools.replay.summary import (Outcome, compare, format_sim_vs_live, format_summary, summarize,
                                           write_out)
from loadtest.tools.replay.trace import (ReplayRequest, TierSpec, build_requests, parse_scale, parse_tiers,
                                         read_trace, scaled_block_tokens)

DEFAULT_GPU_CLUSTER = Path("examples/clusters/mooncake-h100x32.yaml")
CALIBRATION_DIR = Path("loadtest/results/calibration")


def parse_args(argv=None):
    from loadtest.tools import replay  # the package's docstring is the help's description

    p = argparse.ArgumentParser(prog="python -m loadtest.tools.replay", description=replay.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_slice_args(p)
    _add_live_args(p.add_argument_group("live"))
    sim = p.add_argument_group("simulated / stack shape")
    _add_policy_args(sim)
    _add_autoscale_args(sim)
    _add_shape_args(sim)
    return p.parse_args(argv)


def _add_slice_args(p) -> None:
    """Which requests of the trace, scaled how, in which tiers; where the summary goes."""
    p.add_argument("--trace", required=True, type=Path, help="Mooncake-format JSONL trace")
    p.add_argument("--max-requests", type=int, default=None, help="replay this many requests (default: all)")
    p.add_argument("--skip", type=int, default=0, help="start this many requests into the trace")
    p.add_argument("--sample-conversations", type=parse_scale, default=1.0, metavar="FRACTION",
                   help="keep this fraction of the conversations (whole; requests sharing their first two "
                        "blocks), before --skip/--max-requests: a long span at a low rate with its reuse kept")
    p.add_argument("--time-scale", type=parse_scale, default=1.0,
                   help="multiply the trace's times by this (4: the slice takes 4x as long)")
    p.add_argument("--rate-scale", type=parse_scale, default=1.0,
                   help="multiply the offered rate by this (divides the times; combines with --time-scale)")
    p.add_argument("--length-scale", type=parse_scale, default=1.0,
                   help="prompt lengths: a 512-token block becomes round(512 * this) tokens (e.g. 1/16)")
    p.add_argument("--output-scale", type=parse_scale, default=None,
                   help="output lengths: multiplied by this (default: --length-scale)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap on each output (after scaling)")
    p.add_argument("--max-input-tokens", type=int, default=None,
                   help="drop a prompt's trailing blocks past this many tokens (after scaling)")
    p.add_argument("--api-keys", default=None,
                   help="tiers by API key, highest priority first: KEY:TIER:SHARE,... "
                        "(e.g. key-premium:premium:0.3,key-batch:batch:0.7); none: one tier, no key")
    p.add_argument("--slo-ttft-ms", default="5000", help="TTFT SLO: one value, or TIER=MS,... (default 5000)")
    p.add_argument("--slo-tpot-ms", default=None, help="TPOT SLO: one value, or TIER=MS,... (default: none)")
    p.add_argument("--retry-429", type=int, default=0, metavar="N",
                   help="send a 429 again after its Retry-After, N times at most (default 0: count it)")
    p.add_argument("--seed", type=int, default=0, help="tier draw and block text")
    p.add_argument("--out", type=Path, default=None, help="JSON summary (a PNG is written next to it)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-per-request", action="store_true", help="leave the per-request list out of --out")


def _add_live_args(live) -> None:
    """Sending the slice to a running stack (or one started here)."""
    live.add_argument("--url", default="http://127.0.0.1:8000", help="the stack's gateway")
    live.add_argument("--model-name", dest="model_live", default="smollm2-135m",
                      help="the model the stack serves (the request's model field)")
    live.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    live.add_argument("--start-stack", action="store_true",
                      help="start tandem up here for the run (--decode, --kv-cache-memory, --routing, --admission)")
    live.add_argument("--compare-with", type=Path, default=None, metavar="LIVE_JSON",
                      help="with --simulate: compare with a live run of the same slice recorded earlier (its --out)")
    live.add_argument("--compare-sim", action="store_true",
                      help="also simulate the slice on this machine's model (as --simulate cpu) and compare")


def _add_policy_args(sim) -> None:
    """Simulated or live: routing, admission, the prefix cache and the prefill split."""
    sim.add_argument("--simulate", choices=["gpu", "cpu"], default=None,
                     help="simulate instead of sending: gpu (a planned GPU cluster) or cpu (this machine)")
    sim.add_argument("--routing", choices=["kv", "load", "round-robin"], default="kv",
                     help="kv: overlap + load (default); load: overlap weight 0; round-robin: the workers in turn")
    sim.add_argument("--admission", action="store_true",
                     help="tiers get their TTFT SLOs in admission (predicted misses rejected)")
    sim.add_argument("--fallback-workers", type=int, default=3,
                     help="with --admission: where the routing's choice would miss a request's SLO, try this many "
                          "next-cheapest decode workers before rejecting it (0: reject; admission's flag)")
    sim.add_argument("--prefix-cache-blocks", type=int, default=None,
                     help="simulated: prefix-cache blocks per decode worker (default: what its KV pool holds; "
                          "more stands for a host-memory tier, its copy-back untimed)")
    sim.add_argument("--prefill-workers", type=int, default=None,
                     help="gpu: a fixed split: this many of the plan's groups prefill, the rest decode "
                          "(default: as planned); cpu / --start-stack: prefill workers beside --decode "
                          "(default 0; decode workers prefill prompts of up to 512 uncached tokens themselves)")


def _add_autoscale_args(sim) -> None:
    """The autoscaler flipping workers between prefill and decode, and its settings."""
    from shared.policy.autoscale import AutoscaleConfig

    sim.add_argument("--autoscale", action="store_true",
                     help="the autoscaler flips workers between prefill and decode as the load shifts (gpu: the "
                          "plan's groups; cpu / --start-stack: any worker, as long as one decodes)")
    sim.add_argument("--autoscale-interval-s", type=float, default=10.0,
                     help="--start-stack: how often the autoscaler decides (simulated: every tick)")
    sim.add_argument("--autoscale-window-s", type=float, default=30.0, help="the autoscaler's demand window")
    sim.add_argument("--autoscale-cooldown-s", type=float, default=60.0, help="the autoscaler's cooldown")
    sim.add_argument("--autoscale-stabilization-s", type=float, default=AutoscaleConfig.stabilization_s,
                     help="flip only once every tick of this long asked for it (0: at the first)")
    sim.add_argument("--autoscale-decode-capacity", type=float, default=None,
                     help="--start-stack: one decode worker's output tokens/s for the autoscaler (default: its own)")


def _add_shape_args(sim) -> None:
    """The simulated cluster (gpu) or this machine's workers (cpu, --start-stack)."""
    sim.add_argument("--cluster", default=str(DEFAULT_GPU_CLUSTER), help="gpu: cluster YAML")
    sim.add_argument("--model", default="llama-2-70b", help="gpu: model preset or YAML")
    sim.add_argument("--plan", default=None, help="gpu: plan JSON (default: plan the cluster for the slice)")
    sim.add_argument("--decode", type=int, default=2, help="cpu / --start-stack: decode workers")
    sim.add_argument("--kv-cache-memory", default=None,
                     help="cpu / --start-stack: each decode worker's KV pool, e.g. 64MiB (default: the engine's 1GiB)")
    sim.add_argument("--kv-host-memory", default=None,
                     help="cpu / --start-stack: each decode worker's host-memory KV tier, e.g. 2GiB (default: "
                          "none; simulated as a prefix cache of the pool's and the tier's blocks)")
    sim.add_argument("--no-kv-peer-fetch", dest="kv_peer_fetch", action="store_false",
                     help="--start-stack and simulated: decode workers do not fetch cached prefixes from each other "
                          "(live: over NIXL)")
    sim.add_argument("--calibration-dir", default=str(CALIBRATION_DIR), help="cpu: calibrate_sim's output")
    sim.add_argument("--cpu-share", type=float, default=None,
                     help="cpu: each worker's share of the machine (default 1/(--decode + --prefill-workers))")
    sim.add_argument("--max-num-seqs", type=int, default=64, help="cpu: the engine's sequence slots")
    sim.add_argument("--max-num-batched-tokens", type=int, default=512, help="cpu: the engine's step budget")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        tiers = parse_tiers(args.api_keys, args.slo_ttft_ms, args.slo_tpot_ms)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    records = read_trace(args.trace, args.max_requests, args.skip, args.sample_conversations, args.seed)
    if not records:
        print("error: no requests in the slice", file=sys.stderr)
        return 2
    requests = build_requests(records, time_scale=args.time_scale, rate_scale=args.rate_scale,
                              length_scale=args.length_scale, output_scale=args.output_scale,
                              max_output_tokens=args.max_output_tokens, max_input_tokens=args.max_input_tokens,
                              tiers=tiers, seed=args.seed)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config |= {"host": platform.node(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
               "block_tokens": scaled_block_tokens(args.length_scale),
               "retry_policy": f"429 retried after Retry-After, up to {args.retry_429} times"
               if args.retry_429 else "429 counted as rejected, not retried (Retry-After recorded)",
               "truncated_requests": sum(r.truncated for r in requests)}
    extra: dict = {}
    run = replay_simulated if args.simulate else replay_live
    outcomes, summary = run(args, requests, tiers, extra)
    if summary is None:
        return 2
    load = os.getloadavg()[0]
    extra["load_average_1m_at_end"] = load
    if args.out:
        title = (f"{args.trace.name}: {len(requests)} requests, length x{args.length_scale:g}, "
                 f"time x{args.time_scale:g}, rate x{args.rate_scale:g} — "
                 + (f"simulated ({args.simulate})" if args.simulate else "live") + f", {args.routing} routing")
        paths = write_out(args.out, summary, config, outcomes, title, extra, per_request=not args.no_per_request)
        print("wrote", *paths)
    return 0 if summary["failed"] == 0 else 1


def replay_simulated(args, requests: list[ReplayRequest], tiers: list[TierSpec],
                     extra: dict) -> tuple[list[Outcome], dict | None]:
    """``--simulate``: the outcomes and their summary (None: ``--compare-with`` names another
    slice), the run's details and any comparison added to ``extra``."""
    outcomes, info = run_sim(requests, tiers, args)
    summary = summarize(outcomes, requests, tiers, itl_is_tpot=True)
    extra["sim"] = info
    label = f"simulated ({args.simulate}, {info['num_gpus']} devices, {args.routing} routing)"
    print(format_summary(label, summary))
    print(f"simulated {len(requests):,} requests ({info['num_events']:,} events) in {info['wall_s']:.2f} s")
    if args.compare_with:
        live_run = json.loads(args.compare_with.read_text())
        if live_run.get("requests") != summary["requests"]:
            print(f"error: {args.compare_with} has {live_run.get('requests')} requests, this slice "
                  f"{summary['requests']}: not the same slice", file=sys.stderr)
            return outcomes, None
        extra["sim_vs_live"] = compare(summary, live_run)
        extra["compared_with"] = str(args.compare_with)
        print(format_sim_vs_live(extra["sim_vs_live"]))
    return outcomes, summary


def replay_live(args, requests: list[ReplayRequest], tiers: list[TierSpec],
                extra: dict) -> tuple[list[Outcome], dict]:
    """The live run (against ``--url``, or a stack started for it with ``--start-stack``): the
    outcomes and their summary, the run's wall time, split and scaling (and, with
    ``--compare-sim``, the simulator's run and error) added to ``extra``."""
    stack = None
    log = None
    tmp = tempfile.TemporaryDirectory(prefix="tandem-replay-")
    try:
        url = args.url
        if args.start_stack:
            log_path = (args.out.with_suffix(".stack.log") if args.out else Path(tmp.name) / "stack.log")
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(log_path, "w")
            stack = start_stack(args, tiers, Path(tmp.name), log)
            stack.wait_ready(timeout_s=300)
            url = stack.base_url
            print(f"stack ready at {url} ({args.decode} decode workers, {args.routing} routing)", flush=True)
        t0 = time.perf_counter()
        with SplitSampler(url) as split:
            outcomes = run_live(url, args.model_live, requests, seed=args.seed, max_retries=args.retry_429,
                                progress=not args.no_progress, timeout_s=args.timeout_s)
        extra["wall_s"] = time.perf_counter() - t0
        # ready workers per role over the run, and the autoscaler's decisions that acted
        extra["split_over_time"] = [list(s) for s in split.samples]
        extra["scaling"] = _scaling_status(url)
    finally:
        if stack is not None:
            stack.stop()
        if log is not None:
            log.close()
        tmp.cleanup()
    summary = summarize(outcomes, requests, tiers)
    label = f"live ({url if not args.start_stack else 'tandem up'}, {args.routing} routing)"
    print(format_summary(label, summary))
    if args.compare_sim:
        sim_args = argparse.Namespace(**{**vars(args), "simulate": "cpu"})
        sim_outcomes, info = run_sim(requests, tiers, sim_args)
        sim_summary = summarize(sim_outcomes, requests, tiers, itl_is_tpot=True)
        print(format_summary("simulated (cpu)", sim_summary))
        extra["sim"] = {"summary": sim_summary, **info}
        extra["sim_vs_live"] = compare(sim_summary, summary)
        print(format_sim_vs_live(extra["sim_vs_live"]))
    return outcomes, summary


def _scaling_status(url: str) -> dict | None:
    try:
        return status(url).get("scaling")
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
