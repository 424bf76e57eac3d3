"""The benchmarks' common harness: probes of a running server, and on/off comparisons.

Probes: ``is_healthy`` (does ``/health`` answer 200), ``status`` (a gateway's ``/status`` page, what
``tandem status`` shows) and ``log_to`` (a ``Stack``'s ``on_line`` callback writing to a file).

On/off comparisons run the same load against two or more sides in one run — a stack with a
feature on and one with it off, or a stack and an in-process engine. Every side is started first;
``warm_up`` waits until each is ready and sends it a short load; ``alternate`` then runs the load on
each side in turn, ``repeats`` times (``take_turns``), so that a change in the machine's load hits
every side alike, recording each repeat's summary, results and the load average before it.
``comparison`` keeps each side's best repeat (the highest output token throughput, which damps
interference from other work on the machine), applies the benchmark's own ``compare(on, off)`` to
the best pair and to every pair of repeats, and adds what each such report carries: the CPU count,
the number of repeats and the load averages.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

from loadtest.tools.report import format_summary, write_report
from loadtest.tools.runner import run_in_process, run_openai
from loadtest.tools.stats import RequestResult, summarize
from loadtest.tools.workload import RequestSpec

T = TypeVar("T")


def is_healthy(port: int | str, timeout_s: float = 2.0) -> bool:
    """Whether ``/health`` answers 200, on 127.0.0.1:``port`` or at a base URL."""
    base = f"http://127.0.0.1:{port}" if isinstance(port, int) else port.rstrip("/")
    try:
        with urllib.request.urlopen(base + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_healthy(proc, port: int, timeout_s: float, what: str, poll_s: float = 0.2, log=None) -> None:
    """Until ``/health`` of ``proc`` (a server we started, on 127.0.0.1:``port``) answers 200;
    raises when it exits first (naming ``log``, its output, if given) or after ``timeout_s``
    (killed)."""
    deadline = time.monotonic() + timeout_s
    while not is_healthy(port):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before becoming healthy"
                               + (f" (its log: {log})" if log else ""))
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{what} on port {port} not healthy after {timeout_s:.0f}s")
        time.sleep(poll_s)


def status(base_url: str, timeout_s: float = 10.0) -> dict:
    """A gateway's ``/status`` page: its workers (``info`` and last ``load``), services and queues."""
    with urllib.request.urlopen(base_url + "/status", timeout=timeout_s) as resp:
        return json.load(resp)


class SplitSampler:
    """Every ``interval_s``: seconds since ``start`` → ready workers per role, from ``/status``."""

    def __init__(self, base_url: str, interval_s: float = 1.0) -> None:
        self.samples: list[tuple[float, int, int]] = []  # (t, prefill, decode)
        self._url, self._interval = base_url, interval_s
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SplitSampler:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                workers = [w["info"] for w in status(self._url)["workers"] if w["info"]["state"] == "ready"]
            except OSError:
                continue
            self.samples.append((round(time.monotonic() - self._start, 2),
                                 sum(w["role"] == "prefill" for w in workers),
                                 sum(w["role"] == "decode" for w in workers)))


def log_to(file: IO[str], prefix: str = "") -> Callable[[str, str], None]:
    """A ``Stack`` ``on_line`` callback: each child's line to ``file``, after ``prefix`` and its name."""
    return lambda name, line: file.write(f"{prefix}{name:<12}| {line}\n")


def take_turns(sides: dict[str, Callable[[int], T]], rounds: int) -> dict[str, list[T]]:
    """``rounds`` rounds in which each side, in order, measures once (given the round's index):
    side name → its measurements, one a round."""
    out: dict[str, list[T]] = {name: [] for name in sides}
    for i in range(rounds):
        for name, measure_once in sides.items():
            out[name].append(measure_once(i))
    return out


@dataclass(frozen=True)
class Side:
    """One side of a comparison. ``run(specs, progress)`` sends the load and returns each request's
    result; ``ready()`` returns once the side can take it (a stack: ``wait_ready``)."""

    run: Callable[[list[RequestSpec], bool], list[RequestResult]]
    ready: Callable[[], object] = lambda: None


def stack_side(stack, model: str, ready_timeout_s: float = 300.0) -> Side:
    """A started ``Stack``, driven through its gateway's OpenAI API."""
    return Side(run=lambda specs, progress: asyncio.run(run_openai(stack.base_url, model, specs, progress=progress)),
                ready=lambda: stack.wait_ready(timeout_s=ready_timeout_s))


def engine_side(engine) -> Side:
    """An ``AsyncEngine`` in this process, driven directly (no service path)."""
    return Side(run=lambda specs, progress: asyncio.run(run_in_process(engine, specs, progress=progress)))


@dataclass(frozen=True)
class Repeat:
    """One run of the load on one side."""

    summary: dict                 # stats.summarize of the results
    results: list[RequestResult]
    load_average_1m: float        # just before it ran


def warm_up(sides: dict[str, Side], specs: list[RequestSpec]) -> None:
    """Each side in turn: wait until it is ready, then run ``specs`` (first-request costs stay out)."""
    for side in sides.values():
        side.ready()
        side.run(specs, False)


def alternate(sides: dict[str, Side], specs: list[RequestSpec], repeats: int, slo: dict[str, float],
              progress: bool = True) -> dict[str, list[Repeat]]:
    """The same ``specs`` on every side in turn, ``repeats`` times; ``slo``: ``summarize``'s
    ``slo_ttft_s`` and ``slo_tpot_s``."""

    def once(side: Side) -> Callable[[int], Repeat]:
        def run(_: int) -> Repeat:
            load = os.getloadavg()[0]
            results = side.run(specs, progress)
            return Repeat(summarize(results, **slo), results, load)
        return run

    return take_turns({name: once(side) for name, side in sides.items()}, repeats)


def best(runs: dict[str, list[Repeat]]) -> dict[str, Repeat]:
    """Each side's repeat with the highest output token throughput."""
    return {name: max(rs, key=lambda r: r.summary["output_token_throughput"]) for name, rs in runs.items()}


def comparison(runs: dict[str, list[Repeat]], on: str, off: str, compare: Callable[[dict, dict], dict],
               **extra) -> dict:
    """``compare(on, off)`` of the two sides' best summaries, then ``cpu_count``, ``repeats``,
    ``extra``, ``load_average_1m_before`` (per side, one a repeat) and ``all_repeats`` (``compare``
    of each pair of repeats, in order)."""
    top = best(runs)
    return {**compare(top[on].summary, top[off].summary), "cpu_count": os.cpu_count(), "repeats": len(runs[on]),
            **extra,
            "load_average_1m_before": {name: [r.load_average_1m for r in rs] for name, rs in runs.items()},
            "all_repeats": [compare(a.summary, b.summary) for a, b in zip(runs[on], runs[off])]}


def report_comparison(out: Path, name: str, config: dict, runs: dict[str, list[Repeat]],
                      compare: Callable[[dict, dict], dict], sides: dict[str, tuple[str, str]],
                      detail: Callable[[dict], str] = lambda result: "", **extra) -> dict:
    """``comparison`` of the first two of ``sides`` (on, then off; ``extra`` its extra keys), printed
    after each side's best summary and written with them to ``out``/``name``.json and .png.
    ``sides``: each side's label in the printout and its title in the report; ``detail(result)``
    follows the added TTFT in the printout."""
    (on, off), top = list(sides)[:2], best(runs)
    result = comparison(runs, on, off, compare, **extra)
    for side, (label, _) in sides.items():
        print(format_summary(label, top[side].summary))
    print(f"throughput ratio {result['throughput_ratio']:.3f}, added TTFT p50 "
          f"{result['added_ttft_p50_ms']:.1f} ms{detail(result)}"
          f" -> {'meets' if result['meets_targets'] else 'misses'} the targets")
    paths = write_report(out, name, config, {title: (top[side].summary, top[side].results)
                                             for side, (_, title) in sides.items()}, extra={"comparison": result})
    print("wrote", *paths)
    return result


def ratio(on: float | None, off: float | None) -> float | None:
    """``on / off``, or None when either is missing or ``off`` is 0."""
    return on / off if on is not None and off else None
