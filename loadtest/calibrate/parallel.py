"""Calibrate the cost model's tensor-parallel terms on this CPU, then check what it predicts for a
group against the group's measured steps.

    python -m loadtest.calibrate.parallel [--tp 2] [--repeats 5] [--out loadtest/results/calibration/parallel]

A CPU host is described to the planner as a node of one-core "devices" (nominal units, as
``loadtest.calibrate.sim`` does for the whole CPU): a TP=2 group is two rank processes of one
thread each. Everything the prediction uses is measured on one rank or between ranks, never on
the group it predicts:

1. **The model.** ``smollm2-tp`` (``loadtest.tools.synth_model``): SmolLM2-135M's depth and size,
   with 8 heads and 4 KV heads so that TP=2 and TP=4 divide it (SmolLM2's 9 heads allow only TP=3,
   three ranks on a machine of two cores, which the cost model does not describe). Random weights,
   run in float32, made on first use in the cache.
2. **One rank alone** (one process, one thread): prefills and pure decode steps
   (``loadtest.calibrate.sim.measure_step_times``).
3. **What every rank pays per step**: decode steps of ``smollm2-tp-narrow``, the same layers,
   heads and operators with hidden size 64; the intercept of its step time over the batch is the
   step's fixed cost (operator dispatch, the step's bookkeeping), which a group does not divide.
4. **Collectives**: all-reduces of ``[rows, hidden]`` float32 between ``--tp`` rank processes of
   one thread each, over the group's own collectives (shared memory on one host); a line through
   their times gives the fixed cost of one collective and the link's bandwidth.
   **Shared memory bandwidth**: ``--tp`` processes summing a large tensor at once read less than
   ``--tp`` times what one reads alone; what they read together caps a group's ranks' reads (the
   node's ``memory_gbps``, in the cost model's units).
5. **Fit** (``costmodel.calibrate(..., fit_overheads=True)`` with 3 and 4 as its base, a prefill
   reading the weights once: on a CPU a short prompt is bound by that read), then
   **predict** each prefill and decode step of a TP=``--tp`` group with the cost model the planner
   and the simulator step with (``prefill_latency_s``, ``decode_step_s``), and **measure** them on
   a real group (``tensor_parallel_size=--tp``, one thread per rank). The result says whether every
   prediction is within ``--tolerance`` (25%) of the measurement.

Writes, in ``--out``: ``smollm2-tp-cpu.yaml`` (the calibration ``tandem plan --calibration`` reads:
step times, step overhead, collective latency), ``cluster-cpu-cores.yaml`` (this host as a node of
one-core devices, its link the fitted bandwidth), ``smollm2-tp-fp32.yaml`` (the model file),
``parallel_calibration.json`` and ``parallel_calibration.png``. Machines with fewer cores than
``--tp`` are refused: ranks sharing a core measure the scheduler, not the group.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import yaml

from loadtest.calibrate.sim import NOMINAL_GBPS, NOMINAL_TFLOPS, measure_step_times, relative_error
from shared.telemetry.plot import figure

MODEL_SHAPE, PROBE_SHAPE = "smollm2-tp", "smollm2-tp-narrow"
CALIBRATION_FILE, CLUSTER_FILE, MODEL_FILE = "smollm2-tp-cpu.yaml", "cluster-cpu-cores.yaml", "smollm2-tp-fp32.yaml"
COLLECTIVE_ROWS = (1, 4, 16, 64, 256)
COLLECTIVE_CALLS = 200


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m loadtest.calibrate.parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="the group size to predict and measure (default: %(default)s)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help=f"a Hugging Face directory of shape {MODEL_SHAPE} (default: made in the cache on first use)")
    p.add_argument("--prompt-lens", default="32,64,128,256", help="prefill lengths (default: %(default)s)")
    p.add_argument("--batch-sizes", default="1,2,4,8", help="decode batch sizes (default: %(default)s)")
    p.add_argument("--context-len", type=int, default=64, help="decode sequences' prompt length (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per point, the median kept (default: %(default)s)")
    p.add_argument("--tolerance", type=float, default=0.25, help="relative error allowed (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/calibration/parallel"))
    args = p.parse_args(argv)
    if args.tp < 2:
        p.error("--tp must be at least 2")
    return args


def synthetic_dir(shape: str) -> Path:
    """The shape's Hugging Face directory in the cache, written on first use."""
    from kernels.cache_dir import cache_dir
    from loadtest.tools.synth_model import write_model

    path = cache_dir() / "synth" / shape
    if not (path / "config.json").exists():
        print(f"writing the random-weight model {shape} to {path}", flush=True)
        write_model(path, shape, "hf")
    return path


def step_times(model_dir: Path, tp: int, args) -> tuple[list[dict], list[dict]]:
    """Prefill and decode step times of a worker of ``tp`` ranks (one thread each) on ``model_dir``."""
    import torch

    from shared.engine import EngineConfig, LLMEngine, warmup

    prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    torch.set_num_threads(1)
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=tp, num_threads=1,
        compile="off", max_num_seqs=max(batches), kv_cache_memory=128 << 20,
        max_num_batched_tokens=max(512, *prompt_lens)))
    try:
        warmup(engine)
        return measure_step_times(engine, prompt_lens, batches, args.context_len, args.repeats)
    finally:
        engine.close()


def prefill_overhead_s(prefill: list[dict]) -> float:
    """The intercept, over the prompt length, of the narrow model's prefill times: what a prefill
    costs every rank whatever its arithmetic (its operators' dispatch)."""
    slope, intercept = np.polyfit([p["num_tokens"] for p in prefill], [p["seconds"] for p in prefill], 1)
    return max(0.0, float(intercept))


def step_overhead_s(decode: list[dict]) -> tuple[float, float]:
    """(intercept, slope) over the batch size of the narrow model's decode step times: a step's fixed
    cost and a sequence's, both with next to no arithmetic, which a group's ranks each pay whole."""
    slope, intercept = np.polyfit([d["batch"] for d in decode], [d["seconds"] for d in decode], 1)
    return max(0.0, float(intercept)), max(0.0, float(slope))


# --- collectives ---------------------------------------------------------------------------------

def _collective_rank(rank: int, size: int, port: int, hidden: int) -> dict[int, float]:
    """Median seconds of one all-reduce of ``[rows, hidden]`` float32 per row count, on this rank."""
    import torch

    from shared.model.parallel import ProcessGroupCollectives

    torch.set_num_threads(1)
    group = ProcessGroupCollectives(rank, size, "127.0.0.1", port, torch.device("cpu"))
    times = {}
    for rows in COLLECTIVE_ROWS:
        x = torch.ones(rows, hidden)
        for _ in range(20):
            group.all_reduce(x)
        runs = []
        for _ in range(COLLECTIVE_CALLS):
            t0 = time.perf_counter()
            group.all_reduce(x)
            runs.append(time.perf_counter() - t0)
        times[rows] = statistics.median(runs)
    group.all_reduce(torch.ones(1))  # no rank leaves while another still needs it
    return times


def collective_times(tp: int, hidden: int) -> dict[int, float]:
    """Rank 0's all-reduce times between ``tp`` processes (this one is rank 0)."""
    from shared.engine.parallel import free_port

    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    others = [ctx.Process(target=_collective_rank, args=(r, tp, port, hidden), daemon=True) for r in range(1, tp)]
    for proc in others:
        proc.start()
    try:
        return _collective_rank(0, tp, port, hidden)
    finally:
        for proc in others:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


MEMORY_BYTES = 256 << 20
MEMORY_ROUNDS = 8


def _read_rate(ready, go, out) -> None:
    """Bytes per second one thread of this process sums a tensor of ``MEMORY_BYTES`` at, once ``go``
    is set (every reader started together)."""
    import torch

    torch.set_num_threads(1)
    x = torch.ones(MEMORY_BYTES // 4)
    x.sum()
    ready.wait()
    go.wait()
    started = time.perf_counter()
    for _ in range(MEMORY_ROUNDS):
        x.sum()
    out.put(MEMORY_BYTES * MEMORY_ROUNDS / (time.perf_counter() - started))


def memory_share(tp: int) -> tuple[float, float]:
    """(one process's read rate alone, ``tp`` processes' together) in bytes per second."""
    ctx = multiprocessing.get_context("spawn")
    rates = []
    for n in (1, tp):
        ready, go, out = ctx.Barrier(n + 1), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_read_rate, args=(ready, go, out), daemon=True) for _ in range(n)]
        for proc in procs:
            proc.start()
        ready.wait()
        go.set()
        rates.append(sum(out.get(timeout=300) for _ in procs))
        for proc in procs:
            proc.join(30)
    return rates[0], rates[1]


def fit_link(times: dict[int, float], tp: int, hidden: int) -> tuple[float, float]:
    """(latency_s, gbps) of the cost model's all-reduce, ``latency + 2 (tp - 1) / tp * bytes / bandwidth``,
    by least squares over the measured sizes."""
    moved = [2 * (tp - 1) / tp * rows * hidden * 4 for rows in times]
    slope, latency = np.polyfit(moved, list(times.values()), 1)
    return max(0.0, float(latency)), (1.0 / float(slope) / 1e9 if slope > 0 else 1e3)


# --- fit, predict, compare ---------------------------------------------------------------------

def model_spec(model_dir: Path):
    from shared.planner.config import ModelSpec

    cfg = json.loads((model_dir / "config.json").read_text())
    h, layers, inter, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    params = vocab * h + layers * (h * (h + 2 * kv) + h * h + 3 * h * inter + 2 * h) + h
    return ModelSpec(name=f"{MODEL_SHAPE}-fp32", num_layers=layers, hidden_size=h, num_heads=cfg["num_attention_heads"],
                     num_kv_heads=cfg["num_key_value_heads"], vocab_size=vocab, num_params=float(params),
                     bytes_per_param=4.0, kv_bytes_per_elem=4.0, act_bytes_per_elem=4.0)


def core_gpu():
    from shared.planner.config import GpuType

    return GpuType(tflops_bf16=NOMINAL_TFLOPS, hbm_gib=2.0, hbm_gbps=NOMINAL_GBPS, price_per_hour=0.0)


def predict(model, eff, tp: int, link_gbps: float, node_gbps: float, prefill: list[dict],
            decode: list[dict]) -> tuple[list, list]:
    """The cost model's step time for each measured point, on a group of ``tp`` one-core devices
    reading at most ``node_gbps`` (nominal units) together."""
    from shared.planner.costmodel import GroupHardware, Parallel, decode_step_s, prefill_latency_s

    hw = GroupHardware(gpu=core_gpu(), tp_link_gbps=link_gbps, pp_link_gbps=link_gbps, price_per_hour=0.0,
                       node_hbm_gbps=node_gbps)
    par = Parallel(tp=tp, pp=1)
    return ([prefill_latency_s(model, hw, par, eff, p["num_tokens"]) for p in prefill],
            [decode_step_s(model, hw, par, eff, d["batch"], d["context_len"]) for d in decode])


def compare(name: str, prefill: list[dict], decode: list[dict], predicted: tuple[list, list],
            tolerance: float) -> list[dict]:
    rows = []
    for kind, points, key, preds in (("prefill", prefill, "num_tokens", predicted[0]),
                                     ("decode", decode, "batch", predicted[1])):
        for point, pred in zip(points, preds):
            err = relative_error(pred, point["seconds"])
            rows.append({"group": name, "kind": kind, key: point[key], "measured_s": point["seconds"],
                         "predicted_s": pred, "relative_error": err, "within_tolerance": abs(err) <= tolerance})
            label = f"{kind} {'tokens' if kind == 'prefill' else 'batch'} {point[key]}"
            print(f"  {name:<5} {label:<22} measured {point['seconds'] * 1e3:7.1f} ms, predicted "
                  f"{pred * 1e3:7.1f} ms ({err:+.0%})", flush=True)
    return rows


def measure_fixed_costs(args) -> tuple[list[dict], float, float, float]:
    """Step 2: the probe's decode points, and the fixed cost of a decode step, of a sequence and of a prefill."""
    print(f"2/4 the fixed cost of a step ({PROBE_SHAPE})", flush=True)
    probe_prefill, probe = step_times(synthetic_dir(PROBE_SHAPE), 1, args)
    overhead, seq_whole = step_overhead_s(probe)
    prefill_fixed = prefill_overhead_s(probe_prefill)
    print(f"    {overhead * 1e3:.1f} ms per decode step, {seq_whole * 1e3:.2f} ms per sequence and "
          f"{prefill_fixed * 1e3:.1f} ms per prefill on every rank", flush=True)
    return probe, overhead, seq_whole, prefill_fixed


def measure_links(tp: int, hidden: int) -> tuple[dict[int, float], float, float, float, float]:
    """Step 3: all-reduce times by rows and their fit (latency, GB/s); memory read alone and together."""
    print(f"3/4 all-reduces between {tp} ranks", flush=True)
    coll = collective_times(tp, hidden)
    latency, gbps = fit_link(coll, tp, hidden)
    print(f"    {latency * 1e6:.1f} us + bytes at {gbps:.2f} GB/s (rows: "
          + ", ".join(f"{r} {t * 1e6:.0f} us" for r, t in coll.items()) + ")", flush=True)
    alone, together = memory_share(tp)
    print(f"    memory: one process reads {alone / 1e9:.1f} GB/s, {tp} together {together / 1e9:.1f} GB/s "
          f"({together / alone:.2f}x)", flush=True)
    return coll, latency, gbps, alone, together


def fit_efficiency(model, prefill: list[dict], decode: list[dict], latency: float,
                   fixed: tuple[float, float, float], together: float):
    """The cost model's efficiency fitted to one rank's steps, and the cores' shared read limit in its units."""
    from shared.planner.costmodel import DecodeSample, Efficiency, PrefillSample, calibrate

    overhead, seq_whole, prefill_fixed = fixed
    base = Efficiency(link=1.0, comm_latency_s=latency, step_overhead_s=overhead, prefill_reads_weights=True)
    eff = calibrate(model, core_gpu(), [PrefillSample(p["num_tokens"], p["seconds"]) for p in prefill],
                    [DecodeSample(d["batch"], d["context_len"], d["seconds"]) for d in decode], base,
                    fit_overheads=True, seq_undivided_s=seq_whole, prefill_overhead_s=prefill_fixed)
    # the cores' shared limit in the cost model's units: bytes a second it reads at, over the fitted
    # efficiency (a step's reads go at eff.hbm x the nominal rate: the cap binds only when their sum
    # passes what the cores read together)
    node_gbps = together / 1e9 / eff.hbm
    print(f"    fitted: compute {eff.compute:.3f}, memory {eff.hbm:.3f} (one rank's reads at "
          f"{eff.hbm * NOMINAL_GBPS:.1f} GB/s, the ranks' together at most {together / 1e9:.1f}), prefill overhead "
          f"{eff.prefill_overhead_s * 1e3:.1f} ms, {eff.decode_seq_s * 1e3:.2f} ms per sequence whole and "
          f"{eff.decode_seq_tp_s * 1e3:.2f} ms shared by the ranks", flush=True)
    return eff, node_gbps


def check_group(args, model_dir: Path, model, eff, gbps: float, node_gbps: float, prefill_1: list[dict],
                decode_1: list[dict]) -> tuple[list[dict], list[float], bool]:
    """Step 4: one rank's and the group's steps, predicted then measured: every row, the group's errors,
    and whether every one of them is within the tolerance."""
    print(f"4/4 a group of {args.tp} ranks, one thread each: predicted, then measured", flush=True)
    prefill_tp, decode_tp = step_times(model_dir, args.tp, args)
    rows = compare("TP=1", prefill_1, decode_1, predict(model, eff, 1, gbps, node_gbps, prefill_1, decode_1),
                   args.tolerance)
    rows += compare(f"TP={args.tp}", prefill_tp, decode_tp,
                    predict(model, eff, args.tp, gbps, node_gbps, prefill_tp, decode_tp), args.tolerance)
    group_rows = [r for r in rows if r["group"] != "TP=1"]
    errors = [abs(r["relative_error"]) for r in group_rows]
    within = all(r["within_tolerance"] for r in group_rows)
    print(f"TP={args.tp}: median error {statistics.median(errors):.0%}, largest {max(errors):.0%}: "
          f"{'every step within' if within else 'NOT every step within'} {args.tolerance:.0%}", flush=True)
    return rows, errors, within


def main(argv=None) -> int:
    args = parse_args(argv)
    from shared.telemetry.logs import configure_logging

    cores = len(os.sched_getaffinity(0))
    if cores < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} cores; this process may use {cores}")
    configure_logging("calibrate")
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or synthetic_dir(MODEL_SHAPE)
    model = model_spec(model_dir)

    print(f"1/4 one rank alone ({MODEL_SHAPE}, float32, one thread)", flush=True)
    prefill_1, decode_1 = step_times(model_dir, 1, args)
    probe, overhead, seq_whole, prefill_fixed = measure_fixed_costs(args)
    coll, latency, gbps, alone, together = measure_links(args.tp, model.hidden_size)
    eff, node_gbps = fit_efficiency(model, prefill_1, decode_1, latency, (overhead, seq_whole, prefill_fixed),
                                    together)
    rows, errors, within = check_group(args, model_dir, model, eff, gbps, node_gbps, prefill_1, decode_1)

    result = {"host": platform.node(), "processor": platform.processor(), "cores": cores, "tp": args.tp,
              "model": model.model_dump(),
              "config": vars(args) | {"out": str(args.out), "model_dir": str(model_dir)},
              "step_overhead_s": overhead, "seq_undivided_s": seq_whole, "probe_decode": probe,
              "collective": {"rows_s": coll, "latency_s": latency, "gbps": gbps},
              "memory": {"alone_bytes_per_s": alone, "together_bytes_per_s": together, "node_gbps_model_units": node_gbps},
              "efficiency": dataclasses.asdict(eff), "rows": rows,
              "median_error": statistics.median(errors), "max_error": max(errors), "within_tolerance": within}
    _write(args.out, result, model, prefill_1, decode_1, latency, gbps, (overhead, seq_whole, prefill_fixed),
           node_gbps * cores / args.tp)
    return 0


def _write(out: Path, result: dict, model, prefill: list[dict], decode: list[dict], latency: float,
           gbps: float, probe: tuple[float, float, float], node_gbps: float) -> None:
    """``node_gbps``: what every core of the host reads together (nominal units; measured for
    ``--tp`` of them and scaled to them all, a guess past the measured count)."""
    cores = result["cores"]
    strip = lambda points: [{k: v for k, v in p.items() if k != "runs_s"} for p in points]  # noqa: E731
    (out / MODEL_FILE).write_text("# the tensor-parallel calibration's model as the engine runs it: float32\n"
                                  + yaml.safe_dump(model.model_dump(), sort_keys=False))
    calibration = {"model": str(out / MODEL_FILE), "gpu": core_gpu().model_dump(), "prefill": strip(prefill),
                   "decode": strip(decode), "step_overhead_s": probe[0], "decode_seq_undivided_s": probe[1],
                   "prefill_overhead_s": probe[2],
                   "comm_latency_s": latency,
                   "prefill_reads_weights": True, "fit_overheads": True}
    (out / CALIBRATION_FILE).write_text(
        f"# {MODEL_SHAPE} on one core of {platform.node()}, measured by loadtest.calibrate.parallel, "
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}.\n# One rank's step times (one thread), the fixed "
        f"cost of a step every rank pays, and one collective's between ranks.\n"
        + yaml.safe_dump(calibration, sort_keys=False))
    cluster = {"gpu_types": {"core": core_gpu().model_dump()}, "inter_node_gbps": gbps,
               "nodes": [{"name": "local", "gpu_type": "core", "num_gpus": cores, "intra_gbps": gbps,
                          "memory_gbps": node_gbps}]}
    (out / CLUSTER_FILE).write_text("# this host as a node of one-core devices; its link the fitted bandwidth of "
                                    "the ranks' collectives\n" + yaml.safe_dump(cluster, sort_keys=False))
    (out / "parallel_calibration.json").write_text(json.dumps(result, indent=2, default=str))
    rows = result["rows"]
    with figure(out / "parallel_calibration.png", 1, 2, figsize=(11, 4)) as (_, axes):
        for ax, kind, key in ((axes[0], "prefill", "num_tokens"), (axes[1], "decode", "batch")):
            for group in dict.fromkeys(r["group"] for r in rows):
                points = [r for r in rows if r["group"] == group and r["kind"] == kind]
                xs = [r[key] for r in points]
                line, = ax.plot(xs, [r["measured_s"] * 1e3 for r in points], "o-", label=f"{group} measured")
                ax.plot(xs, [r["predicted_s"] * 1e3 for r in points], "x--", color=line.get_color(),
                        label=f"{group} predicted")
            ax.set_xlabel("prompt tokens" if kind == "prefill" else "batch")
            ax.set_ylabel("step ms")
            ax.set_title(kind)
            ax.legend()
    print(f"wrote {out}/{CALIBRATION_FILE}, {CLUSTER_FILE}, {MODEL_FILE}, parallel_calibration.json and .png")


if __name__ == "__main__":
    raise SystemExit(main())
