"""The Batch API filling idle capacity: a batch alone, online traffic alone, and both at once, in one run.

    python -m loadtest.bench.batch [--lines 2000 --online-load 0.5 --online-duration-s 120]

One stack (one decode worker); every request, online or batch line, is a ``/v1/completions`` request
of the same shape (``--prompt-words`` words, ``--output-tokens`` tokens with ``ignore_eos``), so
capacity, the batch's rate and the online rate are all in completed requests per second.

1. **capacity**: the median completed requests/s of ``--capacity-bursts`` saturating bursts of online
   requests (``--capacity-requests`` sent at once);
2. **batch alone**: a ``--lines``-line batch (``files.create`` + ``batches.create`` through the
   official client) run to completion: its lines/s against capacity;
3. **online alone**: Poisson arrivals at ``--online-load`` × capacity for ``--online-duration-s``:
   TTFT and ITL percentiles (``--online-rate R`` sends R requests/s instead, whatever the bursts
   measured: the capacity bursts vary by tens of percent between runs, and the online load with
   them, so settings are compared on equal loads only with a fixed rate);
4. **online beside a batch**: a fresh batch of the same size is created and, once its lines are
   running, the same online schedule is sent again. The batch's rate during that window (its
   completed-line count read at the window's start and end) is compared with the idle capacity,
   capacity − the online rate achieved; online TTFT p90 is compared with step 3's. The batch is
   then cancelled (its partial results are kept; the cancel's latency is reported).

Steps 3 and 4 are one round; ``--rounds`` rounds run (alone first in even rounds, beside first in odd
ones), each after one more capacity burst, and the figures pool every round's requests: on a shared
machine whose speed drifts by tens of percent over minutes, one alone-then-beside pair compared
whichever minutes each happened to get. ``--step-trace FILE`` has the worker write its step trace
there and sums it up per phase (``loadtest/tools/step_trace.py``): how busy the engine was and the
time share of decode steps and of each priority's prefill steps, which shows what online requests
wait behind. Each phase also records the hypervisor's share of the machine's CPU time in it
(``steal`` in ``/proc/stat``, ``loadtest/tools/cpu_steal.py``): on a shared virtual machine it
moves from none to half within a run, and the bench's speed with it.

Batch lines run at a priority below every tier (the gateway's batch runner), so the engine serves
online prefills first and admission sheds batch lines first; ``--batch-in-flight`` is how many lines
the gateway runs at once (the gateway's ``--batch-max-in-flight``) and ``--batch-in-flight-beside-online``
how many while it serves online requests (the gateway's flag of that name: batch rows lengthen every
engine step online rows share). ``--skip-batch-alone`` leaves out step 2 to compare settings of step 4
quickly. Writes ``batch.json`` (pooled figures, and each round's) and ``batch.png`` (the batch's
progress over time in steps 2 and 4, and online TTFT CDFs).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from loadtest.tools import step_trace
from loadtest.tools.cpu_steal import cpu_times, steal_share
from loadtest.tools.runner import run_openai
from loadtest.tools.stats import RequestResult
from loadtest.tools.tandem_server import wait_for_compiled_steps
from loadtest.tools.workload import WorkloadConfig, build_workload
from shared.telemetry.measure import percentile
from shared.telemetry.plot import figure


def start_stack(state: Path, args, log):
    from services.stack.stack import Stack, StackSpec  # noqa: PLC0415

    stack = Stack(StackSpec(state_dir=state, model=args.model, port=0, namespace=f"bb{os.getpid()}",
                            decode_flags={"device": "cpu", "kv_cache_memory": args.kv_cache_memory,
                                          "max_num_seqs": args.max_num_seqs,
                                          **({"step_trace": str(args.step_trace)} if args.step_trace else {})},
                            gateway_flags={"batch_max_in_flight": args.batch_in_flight,
                                           "batch_in_flight_beside_online": args.batch_in_flight_beside_online},
                            admission_flags={"max_waiting_per_worker": args.max_waiting}),
                  on_line=lambda name, line: log.write(f"{name:<12}| {line}\n"))
    stack.start()
    return stack


def rate_of(results: list[RequestResult]) -> float:
    ok = [r for r in results if r.error is None and r.finished_s is not None]
    return len(ok) / max(max(r.finished_s for r in ok) - min(r.started_s for r in ok), 1e-9) if ok else 0.0


def online_summary(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.error is None and r.finished_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [x for r in ok for x in r.itls_s()]
    return {"num_sent": len(results), "num_ok": len(ok), "errors": sorted({r.error for r in results if r.error}),
            "rate_rps": len(ok) / duration_s,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "ttft_p99_s": percentile(ttfts, 99), "itl_p50_s": percentile(itls, 50), "itl_p90_s": percentile(itls, 90),
            "cached_prompt_share": (sum(r.cached_tokens or 0 for r in ok)
                                    / max(sum(r.prompt_tokens or 0 for r in ok), 1))}


def batch_file(args, seed: int) -> bytes:
    specs = build_workload(WorkloadConfig(num_requests=args.lines, rate=1.0, prompt_words=args.prompt_words,
                                          output_tokens=args.output_tokens, spread=0.3, seed=seed))
    return "".join(json.dumps({"custom_id": f"line-{s.index}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": args.model, "prompt": s.prompt, "max_tokens": s.max_tokens,
                                        "temperature": 0, "ignore_eos": True}}) + "\n" for s in specs).encode()


def create_batch(client, args, seed: int):
    upload = client.files.create(file=("lines.jsonl", io.BytesIO(batch_file(args, seed))), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")


class Progress:
    """The batch's completed-line count over time, read by polling ``batches.retrieve``."""
    def __init__(self, client, batch_id: str, t0: float):
        self.client, self.batch_id, self.t0 = client, batch_id, t0
        self.points: list[tuple[float, int, int]] = []   # (seconds since t0, completed, failed)
        self.batch = None

    def poll(self) -> int:
        self.batch = self.client.batches.retrieve(self.batch_id)
        counts = self.batch.request_counts
        done, failed = (counts.completed, counts.failed) if counts else (0, 0)
        self.points.append((time.perf_counter() - self.t0, done, failed))
        return done

    def until(self, predicate, interval_s: float, timeout_s: float):
        end = time.perf_counter() + timeout_s
        while time.perf_counter() < end:
            self.poll()
            if predicate(self.batch):
                return self.batch
            time.sleep(interval_s)
        raise TimeoutError(f"batch {self.batch_id}: {self.batch.status if self.batch else '?'} after {timeout_s:.0f} s")


def batch_alone(client, args, capacity: float, report: dict) -> Progress:
    """Step 2: a batch run to completion on the otherwise idle stack."""
    t0, cpu0 = time.perf_counter(), cpu_times()
    alone = Progress(client, create_batch(client, args, args.seed + 100).id, t0)
    done = alone.until(lambda b: b.status in ("completed", "failed", "cancelled", "expired"), 1.0,
                       args.lines / max(capacity, 0.05) * 10 + 600)
    elapsed = alone.points[-1][0]
    first = next(t for t, c, _ in alone.points if c > 0)
    report["batch_alone"] = {"status": done.status, "lines": args.lines,
                             "completed": done.request_counts.completed, "failed": done.request_counts.failed,
                             "seconds": elapsed, "rate_rps": done.request_counts.completed / elapsed,
                             "rate_after_first_line_rps": done.request_counts.completed / (elapsed - first),
                             "cpu_steal_share": steal_share(cpu0, cpu_times())}
    report["batch_alone"]["fraction_of_capacity"] = report["batch_alone"]["rate_rps"] / capacity
    print(f"batch alone: {done.status}, {done.request_counts.completed}/{args.lines} lines in {elapsed:.0f} s "
          f"= {report['batch_alone']['rate_rps']:.2f} lines/s ({report['batch_alone']['fraction_of_capacity']:.2f}"
          f" of capacity)")
    return alone


@dataclasses.dataclass
class Round:
    """One round: the online schedule alone and the same schedule beside a fresh batch (cancelled after it);
    alone first in even rounds, beside first in odd ones."""

    alone: list[RequestResult]
    beside: list[RequestResult]
    progress: Progress           # the round's batch, seconds since it was created
    window: tuple[float, float]  # the online arrival span, on the progress clock
    lines: int                   # batch lines completed in the window
    window_s: float              # between the polls that bound it
    summary: dict


def tagged(specs, tag: str):
    """The same schedule and lengths with prompts of their own: a segment that sent the other's prompts
    again would find them in the prefix cache (up to 86% of its prompt tokens were, in one run)."""
    return [dataclasses.replace(s, prompt=f"{tag} {s.prompt}") for s in specs]


async def online_while_polling(base_url: str, args, specs, progress: Progress) -> list[RequestResult]:
    """The online schedule, with the batch's progress polled every second while it runs."""
    stop = asyncio.Event()

    async def poll_meanwhile():
        while not stop.is_set():
            await asyncio.to_thread(progress.poll)
            await asyncio.sleep(1.0)

    poller = asyncio.create_task(poll_meanwhile())
    try:
        return await run_openai(base_url, args.model, specs, progress=not args.no_progress)
    finally:
        stop.set()
        await poller


def cancel(client, progress: Progress):
    """Cancel the round's batch and wait until it stops: the batch as it ended and the seconds that took."""
    cancel_t = time.perf_counter()
    if progress.batch.status in ("validating", "in_progress"):  # a small batch may have ended already
        client.batches.cancel(progress.batch_id)
    final = progress.until(lambda b: b.status in ("cancelled", "completed", "failed"), 0.5, 120)
    return final, time.perf_counter() - cancel_t


def run_round(client, args, base_url: str, specs, online, index: int) -> Round:
    span = specs[-1].at_s
    alone_specs, beside_specs = tagged(specs, f"Alone {index}:"), tagged(specs, f"Beside {index}:")
    # odd rounds take the two in the other order, so that a drift in the machine's speed within a
    # round weighs on both alike
    windows: dict[str, tuple[float, float]] = {}  # time.monotonic(), the step trace's clock
    steal: dict[str, float | None] = {}  # the hypervisor's share of the machine's CPU time in each

    def timed(name: str, fn):
        t0, cpu0 = time.monotonic(), cpu_times()
        result = fn()
        windows[name] = (t0, time.monotonic())
        steal[name] = steal_share(cpu0, cpu_times())
        return result

    results_alone = timed("alone", lambda: online(alone_specs)) if index % 2 == 0 else None
    progress = Progress(client, create_batch(client, args, args.seed + 200 + index).id, time.perf_counter())
    progress.until(lambda b: (b.request_counts and b.request_counts.completed >= 2 * args.batch_in_flight)
                   or b.status not in ("validating", "in_progress"), 0.5, 600)
    start_done, window_start = progress.poll(), progress.points[-1][0]
    results_beside = timed("beside", lambda: asyncio.run(online_while_polling(base_url, args, beside_specs,
                                                                              progress)))
    # the window is the online arrival span: the batch's lines completed in it, from the polls
    in_window = [(t, c) for t, c, _ in progress.points if window_start <= t <= window_start + span]
    (ta, ca), (tb, cb) = in_window[0], in_window[-1]
    end_done, window_end = progress.poll(), progress.points[-1][0]
    final, cancel_s = cancel(client, progress)
    if results_alone is None:
        results_alone = timed("alone", lambda: online(alone_specs))
    a, b = online_summary(results_alone, span), online_summary(results_beside, span)
    summary = {"online_alone": a, "online_beside_batch": b, "lines_completed_in_window": cb - ca,
               "window_s": tb - ta, "batch_rate_rps": (cb - ca) / max(tb - ta, 1e-9),
               "online_ttft_p90_ratio": b["ttft_p90_s"] / a["ttft_p90_s"],
               "completed_before_window": start_done, "completed_after_online": end_done,
               "online_ran_s": window_end - window_start, "cancel_s": cancel_s, "final_status": final.status,
               "final_completed": final.request_counts.completed, "output_file_id": final.output_file_id,
               "windows_monotonic": windows, "cpu_steal_share": steal}
    print(f"round {index + 1}: online TTFT p90 {a['ttft_p90_s'] * 1000:.0f} ms alone, "
          f"{b['ttft_p90_s'] * 1000:.0f} ms beside ({summary['online_ttft_p90_ratio']:.2f}x); batch "
          f"{summary['batch_rate_rps']:.2f} lines/s; cancel -> {final.status} in {cancel_s:.1f} s; CPU steal "
          + ", ".join(f"{k} {v:.0%}" for k, v in steal.items() if v is not None))
    return Round(results_alone, results_beside, progress, (window_start, window_start + span), cb - ca, tb - ta,
                 summary)


def pooled(rounds: list[Round], capacity: float, batch_alone_rps: float | None = None) -> dict:
    """Every round's online requests together, alone and beside; the batch's rate over all windows.
    The idle capacity is the burst capacity less the online rate; where the batch alone ran faster
    than the bursts (a sustained load keeps the engine's batch fuller), the same share is also given
    against that rate (``fraction_of_idle_sustained``)."""
    span = sum(rd.window[1] - rd.window[0] for rd in rounds)
    a = online_summary([x for rd in rounds for x in rd.alone], span)
    b = online_summary([x for rd in rounds for x in rd.beside], span)
    batch_rate = sum(rd.lines for rd in rounds) / max(sum(rd.window_s for rd in rounds), 1e-9)
    idle = max(capacity - b["rate_rps"], 1e-9)
    return {"online_alone": a, "online_beside_batch": b,
            "batch_beside_online": {"lines_completed_in_windows": sum(rd.lines for rd in rounds),
                                    "windows_s": sum(rd.window_s for rd in rounds), "rate_rps": batch_rate,
                                    "idle_capacity_rps": idle, "fraction_of_idle_capacity": batch_rate / idle,
                                    **({"idle_sustained_rps": max(batch_alone_rps - b["rate_rps"], 1e-9),
                                        "fraction_of_idle_sustained":
                                            batch_rate / max(batch_alone_rps - b["rate_rps"], 1e-9)}
                                       if batch_alone_rps else {})},
            "online_ttft_p90_ratio": b["ttft_p90_s"] / a["ttft_p90_s"],
            "online_ttft_p50_ratio": b["ttft_p50_s"] / a["ttft_p50_s"],
            "online_itl_p50_ratio": b["itl_p50_s"] / a["itl_p50_s"],
            "cpu_steal_share": {name: _mean([rd.summary.get("cpu_steal_share", {}).get(name) for rd in rounds])
                                for name in ("alone", "beside")}}


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def print_summary(report: dict, rounds: list[Round]) -> None:
    for label, s in (("online alone", report["online_alone"]), ("online beside batch", report["online_beside_batch"])):
        print(f"{label} ({len(rounds)} rounds): {s['num_ok']}/{s['num_sent']} ok, {s['rate_rps']:.2f} req/s, TTFT "
              f"p50/p90 {s['ttft_p50_s'] * 1000:.0f}/{s['ttft_p90_s'] * 1000:.0f} ms, ITL p50/p90 "
              f"{s['itl_p50_s'] * 1000:.0f}/{s['itl_p90_s'] * 1000:.0f} ms")
    bb = report["batch_beside_online"]
    sustained = (f", {bb['fraction_of_idle_sustained']:.2f} of the batch alone's rate less the online rate"
                 if "fraction_of_idle_sustained" in bb else "")
    print(f"batch beside online: {bb['rate_rps']:.2f} lines/s = {bb['fraction_of_idle_capacity']:.2f} of the idle "
          f"capacity ({bb['idle_capacity_rps']:.2f} req/s){sustained}; online TTFT p90 "
          f"{report['online_ttft_p90_ratio']:.2f}x, "
          f"p50 {report['online_ttft_p50_ratio']:.2f}x, ITL p50 {report['online_itl_p50_ratio']:.2f}x alone")
    steal = report["cpu_steal_share"]
    if None not in steal.values():
        print(f"CPU steal (the hypervisor's share): online alone {steal['alone']:.0%}, beside {steal['beside']:.0%}")


def plot(path: Path, alone: Progress | None, rounds: list[Round], online: dict[str, list[RequestResult]]) -> None:
    with figure(path, 1, 2, figsize=(12, 4)) as (fig, axes):
        if alone is not None:
            axes[0].plot([p[0] for p in alone.points], [p[1] for p in alone.points], label="batch alone")
        for i, rd in enumerate(rounds):
            axes[0].plot([p[0] for p in rd.progress.points], [p[1] for p in rd.progress.points],
                         label=f"batch beside online, round {i + 1}")
        if rounds:
            axes[0].axvspan(*rounds[0].window, alpha=0.15, label="online load running (round 1)")
        axes[0].set_title("batch lines completed")
        axes[0].set_xlabel("seconds since the batch was created")
        for label, results in online.items():
            xs = sorted(r.ttft_s * 1000 for r in results if r.error is None and r.ttft_s is not None)
            axes[1].plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        axes[1].set_title("online TTFT (ms), CDF, every round")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lines", type=int, default=2000, help="lines of each batch")
    p.add_argument("--online-load", type=float, default=0.5, help="online arrival rate, a multiple of capacity")
    p.add_argument("--online-rate", type=float, default=None,
                   help="online arrival rate in requests/s (instead of --online-load x the measured capacity)")
    p.add_argument("--online-duration-s", type=float, default=120.0, help="arrival span of the online load")
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--batch-in-flight", type=int, default=32, help="batch lines the gateway runs at once")
    p.add_argument("--batch-in-flight-beside-online", type=int, default=2,
                   help="batch lines the gateway runs at once while it serves online requests")
    p.add_argument("--skip-batch-alone", action="store_true",
                   help="leave out step 2 (the batch alone), e.g. to compare settings of step 4 quickly")
    p.add_argument("--max-waiting", type=int, default=256, help="admission's per-worker queue limit")
    p.add_argument("--capacity-requests", type=int, default=96)
    p.add_argument("--capacity-bursts", type=int, default=2,
                   help="saturating bursts before the first round (every later round runs one more)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of online alone then online beside a fresh batch, pooled (the machine's speed drifts)")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("loadtest/results/batch"))
    p.add_argument("--compile-timeout-s", type=float, default=1800.0,
                   help="how long to wait for the worker's background compile before measuring")
    p.add_argument("--step-trace", type=Path, default=None,
                   help="the worker's step trace file (its --step-trace); summed up per phase into the JSON")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.online_rate is not None and args.online_rate <= 0:
        p.error(f"--online-rate must be positive, not {args.online_rate:g}")
    return args


@dataclasses.dataclass
class Measured:
    """What one run measured: the capacity bursts, the batch alone (unless skipped) and every round."""

    report: dict = dataclasses.field(default_factory=dict)
    rates: list[float] = dataclasses.field(default_factory=list)  # each capacity burst's completed requests/s
    burst_steal: list[float | None] = dataclasses.field(default_factory=list)  # CPU steal share in each burst
    alone: Progress | None = None
    rounds: list[Round] = dataclasses.field(default_factory=list)

    @property
    def capacity(self) -> float:
        return statistics.median(self.rates)


def burst(online, args, cfg: WorkloadConfig, k: int, m: Measured) -> float:
    """One saturating burst of ``--capacity-requests`` online requests: its completed requests/s."""
    specs = build_workload(dataclasses.replace(cfg, num_requests=args.capacity_requests, rate=1000.0,
                                               seed=args.seed + 7 + k))
    cpu0 = cpu_times()
    rate = rate_of(online(specs))
    m.burst_steal.append(steal_share(cpu0, cpu_times()))
    return rate


def measure(client, base_url: str, args, cfg: WorkloadConfig, m: Measured) -> None:
    """Steps 1 to 4 on a ready stack, into ``m``."""
    def online(specs):
        return asyncio.run(run_openai(base_url, args.model, specs, progress=not args.no_progress))

    m.rates.extend(burst(online, args, cfg, k, m) for k in range(args.capacity_bursts))
    print(f"capacity: {m.capacity:.2f} req/s (bursts: {', '.join(f'{r:.2f}' for r in m.rates)})")
    if not args.skip_batch_alone:
        m.alone = batch_alone(client, args, m.capacity, m.report)

    # one online rate for every round (from the first bursts), so that the rounds' results pool
    rate = args.online_rate if args.online_rate is not None else args.online_load * m.capacity
    m.report["online_rate_rps"] = rate
    print(f"online load: {rate:.2f} req/s" + ("" if args.online_rate is not None
                                              else f" ({args.online_load:g} x capacity)"))
    for r in range(args.rounds):
        if r > 0:  # capacity sampled across the run, as the machine's speed drifts with it
            m.rates.append(burst(online, args, cfg, args.capacity_bursts + r - 1, m))
        specs = build_workload(dataclasses.replace(
            cfg, num_requests=max(8, round(rate * args.online_duration_s)), rate=rate, seed=args.seed + 1 + r))
        m.rounds.append(run_round(client, args, base_url, specs, online, r))
    m.report.update(pooled(m.rounds, m.capacity, m.report["batch_alone"]["rate_rps"] if m.alone else None))
    print_summary(m.report, m.rounds)


def run(args) -> Measured:
    """Start the stack, wait for its compiled steps, measure, stop it."""
    import openai  # noqa: PLC0415

    cfg = WorkloadConfig(prompt_words=args.prompt_words, output_tokens=args.output_tokens, spread=0.3, seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    m = Measured()
    with tempfile.TemporaryDirectory() as tmp, open(args.out / "batch_stack.log", "w") as log:
        stack = start_stack(Path(tmp), args, log)
        try:
            stack.wait_ready(timeout_s=300)
            # every phase on the step the worker settles on: a background compile (eager steps meanwhile,
            # and a compiler on the same cores) would otherwise end in the middle of one phase
            m.report["decode_steps"] = wait_for_compiled_steps(stack.base_url,
                                                               time.monotonic() + args.compile_timeout_s)
            client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=2, timeout=120)
            measure(client, stack.base_url, args, cfg, m)
        finally:
            stack.stop()
    return m


def summarize_steps(step_trace_path: Path, m: Measured) -> None:
    """The worker's step trace summed up per phase, into the report."""
    steps = step_trace.read(step_trace_path)
    m.report["steps"] = {name: step_trace.summarize(steps, [rd.summary["windows_monotonic"][name] for rd in m.rounds])
                         for name in ("alone", "beside")}
    for name, summary in m.report["steps"].items():
        print(f"engine steps, online {name}: {step_trace.format_summary(summary)}")


def write_results(args, m: Measured) -> None:
    rounds = m.rounds
    config = {**vars(args), "out": str(args.out), "step_trace": str(args.step_trace) if args.step_trace else None}
    payload = {"config": config, "capacity_rps": m.capacity, "capacity_bursts_rps": m.rates,
               "capacity_bursts_cpu_steal_share": m.burst_steal,
               "cpu_count": os.cpu_count(), "load_average_1m_at_end": os.getloadavg()[0], **m.report,
               "rounds": [rd.summary for rd in rounds],
               "progress": {"alone": m.alone.points if m.alone else None,
                            "beside": [rd.progress.points for rd in rounds]},
               "online_requests": {"alone": [x.to_json() for rd in rounds for x in rd.alone],
                                   "beside": [x.to_json() for rd in rounds for x in rd.beside]}}
    (args.out / "batch.json").write_text(json.dumps(payload, indent=2))
    plot(args.out / "batch.png", m.alone, rounds,
         {"online alone": [x for rd in rounds for x in rd.alone],
          "online beside batch": [x for rd in rounds for x in rd.beside]})
    print("wrote", args.out / "batch.json", args.out / "batch.png")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.step_trace:
        args.step_trace.unlink(missing_ok=True)
    m = run(args)
    if args.step_trace:
        summarize_steps(args.step_trace, m)
    write_results(args, m)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
