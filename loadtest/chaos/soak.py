"""Soak: a long run at moderate load that watches every process for slow leaks.

    python -m loadtest.chaos.soak --duration-s 1800 --concurrency 4

Starts ``tandem up``'s stack (the chaos drill's sizes and settings), drives the chaos drill's closed
greedy load through every gateway, and samples each process's resident memory (RSS) and open file
descriptors from ``/proc`` every ``--sample-s`` seconds: the workers, the services, nats-server and
redis-server. At the end, with the load stopped, it reads the KV blocks each idle worker still uses
(what ``tandem status`` shows). The report gives, per process, RSS and descriptor growth from the
first sample after ``--warm-s`` (start-up allocations are not a leak) to the mean of the last few
samples; requests that failed; leaked blocks. JSON and a plot go to ``--out``.

Not part of the test suite: a meaningful soak takes half an hour. Targets: RSS growth < 5% per
process, 0 leaked blocks, 0 failed requests, descriptors flat.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from loadtest.chaos.drill import ChaosConfig, base_urls, drive, leaked_blocks, stack_spec
from services.stack.stack import Stack
from shared.telemetry.plot import figure

RESULTS = Path(__file__).parents[1] / "results" / "soak"


@dataclass(frozen=True)
class Sample:
    at_s: float
    rss_bytes: int
    num_fds: int


def read_proc(pid: int) -> tuple[int, int] | None:
    """(RSS bytes, open descriptors) of ``pid``, or None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        num_fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return kib * 1024, num_fds


def growth(samples: list[Sample], warm_s: float, tail: int = 3) -> dict:
    """RSS and descriptor growth of one process: from its first sample at or after ``warm_s`` to the
    mean of its last ``tail`` samples (one late sample can catch a transient batch)."""
    settled = [s for s in samples if s.at_s >= warm_s]
    if len(settled) < 2:
        return {"num_samples": len(settled), "rss_growth": None, "fd_growth": None}
    first, last = settled[0], settled[-tail:]
    rss_end = sum(s.rss_bytes for s in last) / len(last)
    # a leak grows in both halves of the run; caches that fill to a size and stay there grow only
    # in the first: the second half's growth tells the two apart (the target is on the whole run)
    middle = next(s for s in settled if s.at_s >= (settled[0].at_s + settled[-1].at_s) / 2)
    return {"num_samples": len(settled), "rss_start_mib": round(first.rss_bytes / 2**20, 1),
            "rss_end_mib": round(rss_end / 2**20, 1),
            "rss_growth": round(rss_end / first.rss_bytes - 1.0, 4) if first.rss_bytes else None,
            "rss_middle_mib": round(middle.rss_bytes / 2**20, 1),
            "rss_growth_second_half": round(rss_end / middle.rss_bytes - 1.0, 4) if middle.rss_bytes else None,
            "fd_start": first.num_fds, "fd_end": last[-1].num_fds,
            "fd_growth": last[-1].num_fds - first.num_fds}


def processes(stack: Stack) -> dict[str, int]:
    """Name → pid of every process of the stack, now (a restarted one has a new pid)."""
    found = {name: child.pid for name, child in stack.children.items() if child.is_running()}
    found.update({server.name: server.pid for server in stack.servers if server.is_running()})
    return found


async def _sample_until(stack: Stack, stop: asyncio.Event, every_s: float,
                        samples: dict[str, list[Sample]], start: float) -> None:
    while not stop.is_set():
        now = round(time.monotonic() - start, 1)
        for name, pid in processes(stack).items():
            if (read := read_proc(pid)) is not None:
                samples.setdefault(name, []).append(Sample(now, *read))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def soak(stack: Stack, cfg: ChaosConfig, duration_s: float, sample_s: float,
               progress: bool) -> tuple[list, dict[str, list[Sample]]]:
    stop, samples = asyncio.Event(), {}
    start = time.monotonic()
    sampler = asyncio.create_task(_sample_until(stack, stop, sample_s, samples, start))
    load = asyncio.create_task(drive(base_urls(stack), cfg, stop, label="soak", progress=progress))
    await asyncio.sleep(duration_s)
    stop.set()
    outcomes = await load
    await sampler
    return outcomes, samples


def report(outcomes: list, samples: dict[str, list[Sample]], leaked: dict[str, int], restarts: dict[str, int],
           warm_s: float, config: dict) -> dict:
    per_process = {name: growth(s, warm_s) for name, s in sorted(samples.items())}
    worst = max((g["rss_growth"] for g in per_process.values() if g["rss_growth"] is not None), default=None)
    return {"config": config, "num_requests": len(outcomes),
            "num_succeeded": sum(o.error is None and o.ended_s is not None for o in outcomes),
            "num_failed": sum(o.error is not None for o in outcomes),
            "num_hung": sum(o.ended_s is None and o.error is None for o in outcomes),
            "worst_rss_growth": worst, "leaked_blocks": leaked, "restarts": restarts,
            "processes": per_process,
            "samples": {name: [dataclasses.asdict(x) for x in s] for name, s in samples.items()}}


def plot(result: dict, path: Path) -> None:
    with figure(path, 2, 1, figsize=(10, 7), sharex=True, dpi=110) as (fig, (rss, fds)):
        for name, samples in sorted(result["samples"].items()):
            t = [s["at_s"] / 60 for s in samples]
            rss.plot(t, [s["rss_bytes"] / 2**20 for s in samples], label=name)
            fds.plot(t, [s["num_fds"] for s in samples], label=name)
        rss.set_ylabel("RSS (MiB)")
        fds.set_ylabel("open descriptors")
        fds.set_xlabel("minutes")
        rss.legend(fontsize=7, ncol=3)
        rss.set_title(f"soak: {result['num_succeeded']}/{result['num_requests']} ok, worst RSS growth "
                      f"{(result['worst_rss_growth'] or 0) * 100:.1f}%, "
                      f"leaked blocks {sum(result['leaked_blocks'].values())}")


def print_report(result: dict) -> None:
    for name, g in result["processes"].items():
        print(f"{name:14} RSS {g.get('rss_start_mib', '-')} -> {g.get('rss_end_mib', '-')} MiB "
              f"({(g['rss_growth'] or 0) * 100:+.1f}%; second half {(g.get('rss_growth_second_half') or 0) * 100:+.1f}%), "
              f"fds {g.get('fd_start', '-')} -> {g.get('fd_end', '-')}")


def reanalyse(path: Path, warm_s: float) -> dict:
    """A saved soak.json's per-process figures computed again from its samples (for runs saved by
    an older version of this script, or another --warm-s)."""
    result = json.loads(path.read_text())
    samples = {name: [Sample(**x) for x in s] for name, s in result["samples"].items()}
    result["processes"] = {name: growth(s, warm_s) for name, s in sorted(samples.items())}
    result["worst_rss_growth"] = max((g["rss_growth"] for g in result["processes"].values()
                                      if g["rss_growth"] is not None), default=None)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=1800.0, help="load duration (default: %(default)s)")
    p.add_argument("--warm-s", type=float, default=120.0, help="growth is measured from here (default: %(default)s)")
    p.add_argument("--sample-s", type=float, default=10.0, help="sampling interval (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=4, help="clients (default: %(default)s)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (default: %(default)s)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS, help="output folder (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--report", type=Path, metavar="SOAK_JSON",
                   help="run nothing: print the figures of a saved soak.json again (with this --warm-s)")
    args = p.parse_args(argv)
    if args.report:
        print_report(reanalyse(args.report, args.warm_s))
        return 0
    cfg = ChaosConfig(num_decode=args.decode, num_prefill=args.prefill, num_gateways=1,
                      concurrency=args.concurrency, max_tokens=args.max_tokens,
                      deadline_s=max(120.0, args.duration_s))
    with tempfile.TemporaryDirectory(prefix="tandem-soak-") as state:
        stack = Stack(stack_spec(cfg, Path(state)), on_line=lambda name, line: None)
        stack.start()
        try:
            stack.wait_ready(timeout_s=cfg.recover_timeout_s)
            outcomes, samples = asyncio.run(soak(stack, cfg, args.duration_s, args.sample_s, not args.no_progress))
            leaked = leaked_blocks(stack, cfg.idle_timeout_s)
            restarts = {name: stack.num_restarts(name) for name in stack.children}
        finally:
            stack.stop()
    config = {**vars(args), "out": str(args.out), "cpu_count": os.cpu_count(), "load_average": os.getloadavg()}
    result = report(outcomes, samples, leaked, restarts, args.warm_s, config)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "soak.png")
    print_report(result)
    print(f"requests {result['num_succeeded']}/{result['num_requests']} ok, {result['num_failed']} failed, "
          f"{result['num_hung']} hung; leaked blocks {result['leaked_blocks'] or 0}; results in {args.out}",
          file=sys.stderr)
    ok = (result["num_failed"] == 0 and result["num_hung"] == 0 and not leaked
          and (result["worst_rss_growth"] or 0) < 0.05)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
