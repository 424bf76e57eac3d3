"""Calibrate the simulator against the real stack on this machine (issue 6, the calibration check).

    python -m loadtest.calibrate.sim [--rate 0.8] [--num-requests 100] [--prompt-words 64] \\
        [--output-tokens 16] [--out loadtest/results/calibration]

In one run:

1. **Step times.** The in-process engine (a decode worker's defaults, its decode step compiled as a
   worker's is once its background compile is done) times prefills at a few prompt lengths (a
   prompt beyond the step budget in the steps of its chunks) and pure decode steps at a few batch
   sizes (median of ``--repeats``),
   stepping on a thread of its own as the decode worker's ``AsyncEngine`` does, with the intra-op
   threads handed over to it (``shared.engine.cpu_threads``; without the hand-over a step there
   took twice as long as on the main thread, and the fit predicted a worker twice as slow as the
   live one). Both are recorded; the fit uses the engine-thread times.
   ``costmodel.calibrate(..., fit_overheads=True)`` fits the cost model to them: compute and
   memory efficiencies plus a fixed per-prefill cost and a per-sequence decode cost. The
   measurements go to ``smollm2-cpu.yaml`` in the calibration format ``tandem plan/simulate
   --calibration`` reads, next to a model file for the float32 weights the engine runs on a CPU.
2. **Simulator.** This machine as a one-device cluster (``cluster-cpu.yaml``: the CPU is the one
   "GPU"; its nominal 1 TFLOP/s and 100 GB/s are units the fitted efficiencies scale, not
   datasheet figures) with one decode worker that prefills locally, like ``tandem up --decode 1``.
   The trace is the load generator's own schedule: the same Poisson arrival times, each prompt's
   token count (tokenized with the model's tokenizer) and output length.
3. **Live.** ``tandem up --decode 1`` (``services.stack.stack.Stack``, embedded nats and redis) on a
   free port, driven open-loop by ``loadtest.tools.runner.run_openai`` with that schedule, then stopped.
4. **Compare.** TTFT and ITL p50/p90, simulator vs live, relative error, and whether each p50 is
   within ``--tolerance`` (25%). The simulator has no per-token times: its ITL is each request's
   mean inter-token time (TPOT); the live side reports both ITL (gaps between streamed chunks)
   and TPOT. Writes ``calibration_sim.json`` and ``calibration_sim.png``.

``--skip-live`` stops after the simulator (for trying fits without loading the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import itertools
import json
import math
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from shared.telemetry.measure import percentiles
from shared.telemetry.plot import figure

NOMINAL_TFLOPS = 1.0     # units for the CPU "GPU": the fitted efficiencies carry the real rates
NOMINAL_GBPS = 100.0
MODEL_FILE = "smollm2-135m-fp32.yaml"
CALIBRATION_FILE = "smollm2-cpu.yaml"
CLUSTER_FILE = "cluster-cpu.yaml"

p50_p90 = functools.partial(percentiles, qs=(50, 90), empty=math.nan)  # what the comparison reports


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="engine model (and planner preset of its shape)")
    p.add_argument("--prefill-lengths", default="16,32,64,128,256", help="prompt tokens to time prefill at")
    p.add_argument("--decode-batches", default="1,2,3,4,6,8", help="batch sizes to time decode steps at")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per point (median kept)")
    p.add_argument("--rate", type=float, default=0.8, help="Poisson arrivals per second (sim and live)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--prompt-words", type=int, default=64, help="fixed prompt length in words")
    p.add_argument("--output-tokens", type=int, default=16, help="fixed output length (ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.25, help="p50 relative error counted as a pass")
    p.add_argument("--skip-live", action="store_true", help="measure, fit and simulate only")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/calibration"))
    return p.parse_args(argv)


# --- pure helpers (unit-tested) ---------------------------------------------------------------

def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured: +0.2 means the simulator predicts 20% too high."""
    return (predicted - measured) / measured


def compare(sim: dict[str, dict[str, float]], live: dict[str, dict[str, float]],
            tolerance: float) -> dict[str, dict]:
    """Per metric and percentile: sim, live, relative error; p50 rows say whether within tolerance."""
    rows: dict[str, dict] = {}
    for metric, sim_q in sim.items():
        for q, s in sim_q.items():
            m = live[metric][q]
            err = relative_error(s, m)
            row = {"sim_s": s, "live_s": m, "rel_error": err}
            if q == "p50":
                row["within_tolerance"] = abs(err) <= tolerance
            rows[f"{metric}_{q}"] = row
    return rows


def cpu_cluster_spec(hbm_gib: float) -> dict:
    """This machine as a one-device cluster: the CPU is the single "GPU" (nominal units)."""
    return {"gpu_types": {"cpu": {"tflops_bf16": NOMINAL_TFLOPS, "hbm_gib": hbm_gib,
                                  "hbm_gbps": NOMINAL_GBPS, "price_per_hour": 0.0}},
            "inter_node_gbps": 1.0,
            "nodes": [{"name": "local", "gpu_type": "cpu", "num_gpus": 1, "intra_gbps": 1.0}]}


# --- 1. step times ----------------------------------------------------------------------------

_SALTS = itertools.count(1000)   # every measured prompt is new: no prefix-cache hits across passes


def _prompt(n: int, salt: int, vocab: int) -> list[int]:
    return [(salt * 7919 + j * 104729 + j * j * 31) % (vocab - 100) + 50 for j in range(n)]


def on_engine_thread(fn, *args):
    """Run ``fn(*args)`` on a fresh thread, as ``AsyncEngine`` steps its engine (the thread takes
    the intra-op threads, this one gives them up: ``shared.engine.cpu_threads``), and return its
    result."""
    from shared.engine import cpu_threads  # noqa: PLC0415 — torch only for the step timings

    box: dict = {}
    num_threads = cpu_threads.engine_thread_count(None)

    def target():
        try:
            cpu_threads.adopt(num_threads)
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 — re-raised on the caller's thread
            box["error"] = exc

    before = cpu_threads.release_calling_thread()
    try:
        thread = threading.Thread(target=target, name="calibrate-engine")
        thread.start()
        thread.join()
    finally:
        cpu_threads.restore(before)
    if "error" in box:
        raise box["error"]
    return box["value"]


def measure_step_times(engine, prefill_lengths, decode_batches, context_len: int, repeats: int):
    """Median wall time of a whole-prompt prefill (fresh prompt, nothing cached; one ``engine.step()``
    up to the engine's step budget, the steps of its chunks beyond it) per length, and of pure decode
    steps of ``batch`` sequences at ``context_len`` tokens."""
    import torch  # noqa: PLC0415

    from shared.engine import SamplingParams

    vocab = engine.model.cfg.vocab_size
    prefill, decode = [], []
    with torch.inference_mode():
        for n in prefill_lengths:
            times = []
            for _ in range(repeats):
                salt = next(_SALTS)
                engine.add_request(f"cal-p{salt}", _prompt(n, salt, vocab),
                                   SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
                t0 = time.perf_counter()
                while engine.has_unfinished_requests():   # max_tokens=1: it ends with its prompt's prefill
                    engine.step()
                times.append(time.perf_counter() - t0)
            prefill.append({"num_tokens": n, "seconds": statistics.median(times), "runs_s": times})
            print(f"  prefill {n:4d} tokens: {statistics.median(times) * 1e3:7.1f} ms", flush=True)
        for b in decode_batches:
            salt = next(_SALTS)
            for i in range(b):
                engine.add_request(f"cal-d{salt}-{i}", _prompt(context_len, salt * 31 + i, vocab),
                                   SamplingParams(max_tokens=repeats + 8, temperature=0.0, ignore_eos=True))
            sched = engine.scheduler
            while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
                engine.step()       # prefill every prompt first
            engine.step()           # one untimed decode step
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            while engine.has_unfinished_requests():
                engine.step()
            decode.append({"batch": b, "context_len": context_len + 1, "seconds": statistics.median(times),
                           "runs_s": times})
            print(f"  decode batch {b:2d}: {statistics.median(times) * 1e3:7.1f} ms/step", flush=True)
    return prefill, decode


# --- 2. simulator -----------------------------------------------------------------------------

def simulate(cluster_path: Path, model, eff, specs, input_lens: list[int], slo_ttft_s: float = 60.0,
             admission=None, tier_mix=None, tiers: list[str] | None = None, max_num_seqs: int | None = None,
             local_prefill_batch_tokens: int | None = None, max_waiting_per_worker: int | None = None):
    """``admission`` and ``tier_mix`` (SimConfig's) or ``tiers`` (each request's): tiers and their
    SLOs, rejections allowed; unset, loose SLOs under which a rejection is an error.
    ``max_num_seqs``: the live worker's sequence slots (None: the batch bounded by KV memory only);
    ``local_prefill_batch_tokens``: its token budget per step, prompts prefilled together within it
    (None: one prompt per step); ``max_waiting_per_worker``: admission's queue limit (None: the
    routing default)."""
    from shared.planner.config import Slo, WorkloadSpec, load_cluster
    from shared.planner.devices import Cluster
    from shared.planner.flow import Evaluator
    from shared.planner.plan import Plan, WorkerPlan
    from shared.policy.disagg import DisaggConfig
    from shared.policy.kv_routing import RoutingWeights
    from shared.sim.simulator import SimConfig, Simulator, workload_admission
    from shared.sim.traces import Trace

    spec = load_cluster(cluster_path)
    mean_in = float(np.mean(input_lens))
    mean_out = float(np.mean([s.max_tokens for s in specs]))
    rate = len(specs) / max(specs[-1].at_s, 1e-9)
    # Loose SLOs: the comparison is of latencies, not of what admission would reject.
    workload = WorkloadSpec(request_rate=rate, input_len=round(mean_in), output_len=round(mean_out), length_cv=0,
                            slo=Slo(ttft_s=slo_ttft_s, tpot_s=10.0))
    ev = Evaluator(Cluster(spec), model, workload, eff)
    plan = Plan(model=model.name, num_gpus=1, request_rate=rate, mean_input_len=mean_in, mean_output_len=mean_out,
                slo=workload.slo,
                workers=[WorkerPlan(worker_id="decode-1", role="decode", gpu_type="cpu", gpus=["local/gpu0"],
                                    tp=1, pp=1, capacity_rps=0.0, assigned_rps=rate, latency_s=0.0,
                                    price_per_hour=0.0)],
                routes=[], capacity_rps=0.0, throughput_rps=rate, output_tokens_per_s=rate * mean_out,
                predicted_ttft_s=None, predicted_tpot_s=None, cost_per_hour=0.0,
                cost_per_million_output_tokens=None, planning_time_s=0.0, search_history=[])
    trace = Trace(np.array([s.at_s for s in specs], dtype=float), np.array(input_lens, dtype=np.int64),
                  np.array([s.max_tokens for s in specs], dtype=np.int64), tiers=tiers)
    cfg = SimConfig(disagg=DisaggConfig(max_local_prefill_tokens=1 << 30),
                    admission=admission or workload_admission(slo_ttft_s), max_num_seqs=max_num_seqs,
                    local_prefill_batch_tokens=local_prefill_batch_tokens,
                    **({"routing": RoutingWeights(max_waiting_per_worker=max_waiting_per_worker)}
                       if max_waiting_per_worker is not None else {}),
                    **({"tier_mix": tier_mix} if tier_mix else {}))
    result = Simulator(ev, plan, cfg, block_size=trace.block_size).run(trace)
    if admission is not None:
        return result
    if result.rejected.any():
        raise RuntimeError(f"the simulator rejected {int(result.rejected.sum())} requests: {result.rejections}")
    busy = float(np.mean(result.decode_kv_util)) if result.decode_kv_util else 0.0
    return {"ttft_s": result.ttft_s.tolist(), "tpot_s": result.tpot_s.tolist(), "kv_util_mean": busy}


# --- 3. live stack ----------------------------------------------------------------------------

def run_live(model: str, specs, slo_ttft_s: float, slo_tpot_s: float, log_path: Path):
    from loadtest.tools.runner import run_openai
    from loadtest.tools.stats import summarize
    from services.stack.stack import Stack, StackSpec

    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tandem-cal-") as state:
        stack = Stack(StackSpec(state_dir=Path(state), num_decode=1, model=model, port=0, log_level="WARNING"),
                      on_line=lambda name, line: lines.append(f"{name:<12}| {line}"))
        try:
            t0 = time.perf_counter()
            stack.start()
            stack.wait_ready(timeout_s=300)
            print(f"  stack ready at {stack.base_url} in {time.perf_counter() - t0:.0f} s", flush=True)
            results = asyncio.run(run_openai(stack.base_url, model, specs, progress=False))
        finally:
            stack.stop()
            log_path.write_text("\n".join(lines[-400:]) + "\n")
    return results, summarize(results, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)


# --- 4. report --------------------------------------------------------------------------------

def plot(result: dict, path: Path) -> None:
    rows = result["comparison"]
    with figure(path, 1, 2, figsize=(12, 4.2), dpi=110) as (fig, (ax1, ax2)):
        keys = list(rows)
        xs = np.arange(len(keys))
        ax1.bar(xs - 0.2, [rows[k]["sim_s"] * 1e3 for k in keys], 0.4, label="simulator")
        ax1.bar(xs + 0.2, [rows[k]["live_s"] * 1e3 for k in keys], 0.4, label="live stack")
        for x, k in zip(xs, keys):
            ax1.annotate(f"{rows[k]['rel_error']:+.0%}", (x, max(rows[k]["sim_s"], rows[k]["live_s"]) * 1e3),
                         ha="center", va="bottom", fontsize=8)
        ax1.set_xticks(xs, [k.replace("_", "\n") for k in keys], fontsize=8)
        ax1.set_ylabel("ms")
        ax1.set_title(f"simulator vs live (error: sim vs live; p50 pass: |err| <= {result['config']['tolerance']:.0%})",
                      fontsize=9)
        ax1.legend()
        cal = result["calibration"]
        fit = result["fit"]
        ax2.plot([p["num_tokens"] for p in cal["prefill"]], [p["seconds"] * 1e3 for p in cal["prefill"]], "o",
                 label="prefill, measured (x: prompt tokens)")
        ax2.plot([p["num_tokens"] for p in cal["prefill"]], [p["fit_s"] * 1e3 for p in cal["prefill"]], "-",
                 label="prefill, fitted cost model")
        ax2b = ax2.twiny()
        ax2b.plot([d["batch"] for d in cal["decode"]], [d["seconds"] * 1e3 for d in cal["decode"]], "s",
                  color="tab:red", label="decode step, measured (top x: batch)")
        ax2b.plot([d["batch"] for d in cal["decode"]], [d["fit_s"] * 1e3 for d in cal["decode"]], "-",
                  color="tab:red", label="decode step, fitted")
        ax2.set_xlabel("prompt tokens")
        ax2b.set_xlabel("decode batch")
        ax2.set_ylabel("ms per step")
        h1, l1 = ax2.get_legend_handles_labels()
        h2, l2 = ax2b.get_legend_handles_labels()
        ax2.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
        ax2.set_title(f"step times (compute eff {fit['compute']:.3f}, hbm eff {fit['hbm']:.3f}, "
                      f"+{fit['prefill_overhead_s'] * 1e3:.0f} ms/prefill, +{fit['decode_seq_s'] * 1e3:.1f} ms/seq)",
                      fontsize=8)
        fig.suptitle(result["title"], fontsize=10)


def main(argv=None) -> int:
    args = parse_args(argv)
    from loadtest.tools.workload import WorkloadConfig, build_workload
    from shared.telemetry.logs import configure_logging

    configure_logging("calibrate")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    # The workload both sides serve: fixed prompt and output lengths, Poisson arrivals.
    wl = WorkloadConfig(num_requests=args.num_requests, rate=args.rate, burstiness=1.0,
                        prompt_words=args.prompt_words, output_tokens=args.output_tokens, spread=0.0,
                        seed=args.seed)
    specs = build_workload(wl)

    print("1. step times (in-process engine)", flush=True)
    steps = measure_steps(args, specs)
    cal_path = write_calibration(args, steps, started)
    model, eff, eff_ratio = fit(cal_path, steps)

    print("2. simulator", flush=True)
    cluster_path, sim, sim_ratio = simulate_fits(args, model, (eff, eff_ratio), specs, steps.input_lens)
    sim_q = {"ttft": p50_p90(sim["ttft_s"]), "itl": p50_p90(sim["tpot_s"])}
    result = {
        "title": (f"{args.model} on {platform.node() or 'this machine'} ({steps.device}, {steps.threads} threads): "
                  f"{args.num_requests} req at {args.rate:g}/s, {np.mean(steps.input_lens):.0f} in / "
                  f"{args.output_tokens} out"),
        "started_utc": started, "host": platform.node(), "device": steps.device, "torch_threads": steps.threads,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "workload": dataclasses.asdict(wl) | {"input_tokens_mean": float(np.mean(steps.input_lens)),
                                              "input_tokens_min": int(min(steps.input_lens)),
                                              "input_tokens_max": int(max(steps.input_lens)),
                                              "decode_context_len": steps.context_len},
        "calibration": {"prefill": steps.prefill, "decode": steps.decode, "file": str(cal_path),
                        "measured_on": "engine thread (as AsyncEngine in the decode worker)"},
        "main_thread_step_times": {"prefill": steps.main_prefill, "decode": steps.main_decode,
                                   "note": "same steps on the main thread; not used by the fit"},
        "fit": {k: getattr(eff, k) for k in ("compute", "hbm", "prefill_overhead_s", "decode_seq_s")},
        "fit_ratio_only": {"compute": eff_ratio.compute, "hbm": eff_ratio.hbm},
        "sim": {"ttft": sim_q["ttft"], "itl_is_tpot": sim_q["itl"],
                "tpot": p50_p90(sim["tpot_s"]), "kv_util_mean": sim["kv_util_mean"]},
        "sim_ratio_only_fit": {"ttft": p50_p90(sim_ratio["ttft_s"]), "tpot": p50_p90(sim_ratio["tpot_s"])},
    }
    if args.skip_live:
        (args.out / "calibration_sim.json").write_text(json.dumps(result, indent=2))
        print("skipped the live stack (--skip-live)")
        return 0

    print(f"3. live stack: {args.num_requests} requests at {args.rate:g}/s", flush=True)
    comparison = compare_live(args, specs, sim_q, result)
    print(f"\n{'metric':<10} {'sim ms':>9} {'live ms':>9} {'error':>8}  within {args.tolerance:.0%}")
    for k, row in comparison.items():
        flag = {True: "yes", False: "NO"}.get(row.get("within_tolerance"), "")
        print(f"{k:<10} {row['sim_s'] * 1e3:9.1f} {row['live_s'] * 1e3:9.1f} {row['rel_error']:+8.1%}  {flag}")
    print("(sim ITL = per-request TPOT; tpot rows compare it with the live per-request TPOT)")
    print(f"wrote {args.out / 'calibration_sim.json'}, {args.out / 'calibration_sim.png'}, {cal_path}, {cluster_path}")
    return 0


HBM_GIB = 2.0  # the CPU "GPU"'s memory: the engine's default 1 GiB CPU KV pool plus the float32 weights, with headroom


@dataclasses.dataclass
class StepTimes:
    """Step 1's measurements: the fitted ones (engine thread), the main thread's for the record."""

    prefill: list[dict]
    decode: list[dict]
    main_prefill: list[dict]
    main_decode: list[dict]
    input_lens: list[int]  # each request's prompt tokens
    context_len: int       # the decode steps' context: the mean prompt plus half the output
    threads: int
    device: str


def measure_steps(args, specs) -> StepTimes:
    """The in-process engine's prefill and decode step times, its decode step compiled as a decode
    worker runs it once its background compile is done."""
    import torch

    from shared.engine import EngineConfig, LLMEngine, warmup

    engine = LLMEngine.from_config(EngineConfig(model=args.model, compile="on"))
    warmup(engine)
    input_lens = [len(engine.tokenizer.encode(s.prompt)) for s in specs]
    ctx = round(float(np.mean(input_lens)) + args.output_tokens / 2)
    lengths = [int(x) for x in args.prefill_lengths.split(",")]
    batches = [int(x) for x in args.decode_batches.split(",")]
    print("  on the main thread (for the record):", flush=True)
    main_prefill, main_decode = measure_step_times(engine, lengths, batches, ctx, args.repeats)
    print("  on an engine thread, as the decode worker runs (these are fitted):", flush=True)
    prefill, decode = on_engine_thread(measure_step_times, engine, lengths, batches, ctx, args.repeats)
    return StepTimes(prefill, decode, main_prefill, main_decode, input_lens, ctx, torch.get_num_threads(),
                     str(engine.device))


def write_calibration(args, steps: StepTimes, started: str) -> Path:
    """The model file (float32 weights and KV, as the engine runs it here) and the calibration file
    of ``steps``, in ``args.out``; returns the calibration file's path."""
    from shared.planner.config import MODEL_PRESETS, GpuType

    base = MODEL_PRESETS[args.model]
    model_spec = base.model_copy(update={"name": f"{base.name}-fp32", "bytes_per_param": 4.0,
                                         "kv_bytes_per_elem": 4.0})
    model_path, cal_path = args.out / MODEL_FILE, args.out / CALIBRATION_FILE
    model_path.write_text("# SmolLM2-135M as the engine runs it on a CPU: float32 weights and KV cache\n"
                          + yaml.safe_dump(model_spec.model_dump(), sort_keys=False))
    gpu = GpuType(tflops_bf16=NOMINAL_TFLOPS, hbm_gib=HBM_GIB, hbm_gbps=NOMINAL_GBPS, price_per_hour=0.0)
    cal_doc = {"model": str(model_path), "gpu": gpu.model_dump(),
               "prefill": [{"num_tokens": p["num_tokens"], "seconds": round(p["seconds"], 6)} for p in steps.prefill],
               "decode": [{"batch": d["batch"], "context_len": d["context_len"], "seconds": round(d["seconds"], 6)}
                          for d in steps.decode]}
    cal_path.write_text(
        f"# SmolLM2-135M step times measured by loadtest/calibrate/sim.py on {platform.node() or 'this machine'} "
        f"({steps.device}, {steps.threads} torch threads), {started}.\n"
        "# Median wall time, stepped on its own thread as the decode worker does: a whole-prompt prefill\n"
        "# (one engine.step(), or its chunks' steps beyond the step budget), or a pure decode step of\n"
        "# `batch` sequences (the decode step compiled).\n"
        f"# The CPU is described in nominal units ({NOMINAL_TFLOPS:g} TFLOP/s, {NOMINAL_GBPS:g} GB/s);\n"
        "# the fitted efficiencies carry the real rates. `model` is a path relative to the repository root.\n"
        + yaml.safe_dump(cal_doc, sort_keys=False))
    return cal_path


def fit(cal_path: Path, steps: StepTimes):
    """(model, fitted efficiencies, the plain median-ratio fit's), read back through the planner's own
    loader; each step of ``steps`` gets what both fits predict for it (``fit_s``, ``ratio_fit_s``)."""
    from shared.planner.config import load_calibration, load_model
    from shared.planner.costmodel import (DecodeSample, GroupHardware, Parallel, PrefillSample, calibrate,
                                          decode_step_s, prefill_latency_s)

    cal = load_calibration(cal_path)
    model = load_model(cal.model)
    pre_samples = [PrefillSample(m.num_tokens, m.seconds) for m in cal.prefill]
    dec_samples = [DecodeSample(m.batch, m.context_len, m.seconds) for m in cal.decode]
    eff = calibrate(model, cal.gpu, pre_samples, dec_samples, fit_overheads=True)
    eff_ratio = calibrate(model, cal.gpu, pre_samples, dec_samples)
    hw = GroupHardware(gpu=cal.gpu, tp_link_gbps=1.0, pp_link_gbps=1.0, price_per_hour=0.0)
    one = Parallel(1, 1)
    for p in steps.prefill:
        p["fit_s"] = prefill_latency_s(model, hw, one, eff, p["num_tokens"])
        p["ratio_fit_s"] = prefill_latency_s(model, hw, one, eff_ratio, p["num_tokens"])
    for d in steps.decode:
        d["fit_s"] = decode_step_s(model, hw, one, eff, d["batch"], d["context_len"])
        d["ratio_fit_s"] = decode_step_s(model, hw, one, eff_ratio, d["batch"], d["context_len"])
    print(f"  fit: compute eff {eff.compute:.4f} (x {NOMINAL_TFLOPS:g} TFLOP/s), hbm eff {eff.hbm:.4f} "
          f"(x {NOMINAL_GBPS:g} GB/s), prefill overhead {eff.prefill_overhead_s * 1e3:.1f} ms, "
          f"decode {eff.decode_seq_s * 1e3:.2f} ms/sequence", flush=True)
    return model, eff, eff_ratio


def simulate_fits(args, model, fits, specs, input_lens: list[int]):
    """This machine as a one-device cluster (written to ``args.out``), simulated with each of ``fits``:
    (the cluster file, the first fit's result, the second's)."""
    cluster_path = args.out / CLUSTER_FILE
    cluster_path.write_text("# This machine as a one-device cluster for `tandem plan/simulate`: the CPU is the one\n"
                            "# \"GPU\", in nominal units; use with --calibration smollm2-cpu.yaml\n"
                            + yaml.safe_dump(cpu_cluster_spec(HBM_GIB), sort_keys=False))
    sim, sim_ratio = (simulate(cluster_path, model, eff, specs, input_lens) for eff in fits)
    print(f"  sim TTFT p50 {p50_p90(sim['ttft_s'])['p50'] * 1e3:.0f} ms, ITL(TPOT) p50 "
          f"{p50_p90(sim['tpot_s'])['p50'] * 1e3:.1f} ms", flush=True)
    return cluster_path, sim, sim_ratio


def compare_live(args, specs, sim_q: dict, result: dict) -> dict:
    """Run the live stack on ``specs``, add its figures and the comparison to ``result``, write
    calibration_sim.json and its plot; returns the comparison."""
    results, summary = run_live(args.model, specs, 60.0, 10.0, args.out / "live_stack.log")
    if summary["num_errors"]:
        print(f"  {summary['num_errors']} errors: {summary['errors']}", flush=True)
    ok = [r for r in results if r.error is None and r.finished_s is not None]
    live_q = {"ttft": p50_p90([r.ttft_s for r in ok]),
              "itl": p50_p90([x for r in ok for x in r.itls_s()]),
              "tpot": p50_p90([r.tpot_s for r in ok])}
    comparison = compare({"ttft": sim_q["ttft"], "itl": sim_q["itl"]},
                         {"ttft": live_q["ttft"], "itl": live_q["itl"]}, args.tolerance)
    for q in ("p50", "p90"):
        comparison[f"tpot_{q}"] = {"sim_s": sim_q["itl"][q], "live_s": live_q["tpot"][q],
                                   "rel_error": relative_error(sim_q["itl"][q], live_q["tpot"][q])}
    result |= {"live": {"ttft": live_q["ttft"], "itl": live_q["itl"], "tpot": live_q["tpot"],
                        "num_ok": summary["num_ok"], "num_errors": summary["num_errors"],
                        "errors": summary["errors"], "duration_s": summary["duration_s"],
                        "output_token_throughput": summary["output_token_throughput"]},
               "live_requests": [r.to_json() for r in results],
               "comparison": comparison,
               "sim_ratio_only_vs_live": compare({"ttft": result["sim_ratio_only_fit"]["ttft"],
                                                  "itl": result["sim_ratio_only_fit"]["tpot"]},
                                                 {"ttft": live_q["ttft"], "itl": live_q["itl"]}, args.tolerance)}
    (args.out / "calibration_sim.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "calibration_sim.png")
    return comparison


if __name__ == "__main__":
    raise SystemExit(main())
