"""Fault drill: a greedy workload at fixed concurrency against a whole stack (``tandem up``'s
``Stack``, supervised, with embedded nats-server and redis-server), one fault at a time.

    python -m loadtest.chaos.drill [--decode 2 --prefill 1 --gateways 2] [--concurrency 16] \\
        [--faults kill-decode,stop-decode,...] [--warm-s 5 --after-s 20] [--out loadtest/results/chaos]

First a fault-free reference run records every prompt's greedy output (temperature 0, ignore_eos,
fixed max_tokens). Then, per fault: the load runs ``--warm-s``, the fault is injected, the load
goes on ``--after-s`` and stops; the drill waits for every request (each bounded by
``--deadline-s``: still running then = hung), for the stack to be whole and ready again, and for
every worker to be idle, and reads the KV blocks each worker still uses (leaked). Per fault it
reports requests sent / succeeded / failed (by kind) / hung / differing from the reference, the time
from the fault to the first success of a request sent after it, leaked blocks and restarts seen.
Writes ``chaos.json`` and ``chaos.png`` to ``--out`` and the stack's log to ``chaos_stack.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from tqdm import tqdm

from loadtest.chaos.faults import FAULTS, FaultOptions, inject, skip_reason
from loadtest.chaos.report import (FaultReport, RequestOutcome, fault_report, format_table, format_totals, plot,
                                   report_from_json, skipped_report, totals)
from loadtest.tools import sse
from loadtest.tools.harness import status
from services.stack.stack import Stack, StackSpec
from services.stack.supervisor import Backoff

_TOPICS = ("a lighthouse keeper", "the history of bread", "a robot learning to paint", "volcanoes",
           "a chess tournament", "the moons of Jupiter", "a lost umbrella", "how bees communicate",
           "an old violin", "the first day of school", "a city under the sea", "tea ceremonies",
           "a desert caravan", "how bridges are built", "a fox in winter", "the printing press")


@dataclass(frozen=True)
class ChaosConfig:
    faults: tuple[str, ...] = tuple(FAULTS)
    num_decode: int = 2
    num_prefill: int = 1
    num_gateways: int = 2             # kill-gateway kills one of them
    concurrency: int = 16
    num_prompts: int = 16
    max_tokens: int = 32
    warm_s: float = 5.0
    after_s: float = 20.0
    deadline_s: float = 120.0         # per request: not ended by then = hung
    recover_timeout_s: float = 300.0  # for the stack to be whole and ready again after a fault
    idle_timeout_s: float = 10.0      # for every worker's KV blocks to be free once idle
    model: str = "smollm2-135m"
    device: str = "cpu"
    kv_cache_memory: str = "128MiB"
    # a request moved to another worker must give the reference's tokens: float32, or None for the
    # workers' automatic precision (int8 on a VNNI CPU), whose replay of a moved request's tokens is
    # meant to be exact too (ModelRunner.split, Request.prefill_end)
    dtype: str | None = "float32"
    fault_options: FaultOptions = FaultOptions()


def prompts(num: int) -> list[str]:
    return [f"Write a short story about {_TOPICS[i % len(_TOPICS)]}" + (f", part {i // len(_TOPICS) + 1}"
                                                                       if i >= len(_TOPICS) else "") + "."
            for i in range(num)]


def stack_spec(cfg: ChaosConfig, state_dir: Path, **overrides) -> StackSpec:
    """A supervised stack (restarts its children) of the configured sizes; decode workers prefill
    nothing locally when there are prefill workers, so the prefill path carries every request."""
    engine = {"max_model_len": 1024, "kv_cache_memory": cfg.kv_cache_memory, "device": cfg.device,
              "dtype": cfg.dtype, "num_warmup_requests": 1}
    local = {"max_local_prefill_tokens": 0} if cfg.num_prefill else {}
    kw = dict(state_dir=state_dir, num_decode=cfg.num_decode, num_prefill=cfg.num_prefill, model=cfg.model,
              port=0, namespace=f"chaos{os.getpid()}", registry_ttl_s=3.0, restart_children=True,
              restart_backoff=Backoff(initial_s=0.2, max_s=2.0), decode_flags={**engine, **local},
              prefill_flags=engine, num_gateways=cfg.num_gateways)
    return StackSpec(**{**kw, **overrides})


async def _request(session: aiohttp.ClientSession, url: str, body: dict, outcome: RequestOutcome,
                   start: float) -> None:
    """One streaming completion into ``outcome`` (its text, or the kind of error it ended with);
    times from ``start`` (time.monotonic())."""
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                await resp.read()
                outcome.error = f"HTTP {resp.status}"
                return
            text, done = [], False
            async for event in sse.aevents(resp.content):
                if event == sse.DONE:
                    done = True
                    continue
                if "error" in event:
                    outcome.error = f"stream error {event['error'].get('code') or event['error'].get('type')}"
                    return
                text += [c.get("text") or "" for c in event.get("choices", [])]
                if outcome.first_token_s is None and any(text):
                    outcome.first_token_s = round(time.monotonic() - start, 3)
            outcome.text = "".join(text)
            if not done:
                outcome.error = "stream cut"
    except aiohttp.ClientConnectorError:
        raise  # nothing was sent: the caller may try another gateway
    except aiohttp.ClientError as exc:
        outcome.error = f"connection {type(exc).__name__}"


async def _failing_over(session: aiohttp.ClientSession, urls: list[str], i: int, body: dict,
                        outcome: RequestOutcome, start: float) -> None:
    for k in range(len(urls)):
        outcome.error = None
        try:
            return await _request(session, urls[(i + k) % len(urls)] + "/v1/completions", body, outcome, start)
        except aiohttp.ClientConnectorError as exc:
            outcome.error = f"connection {type(exc).__name__}"  # every gateway refused: it stays


async def drive(urls: list[str], cfg: ChaosConfig, stop: asyncio.Event, *, num_requests: int | None = None,
                label: str = "load", progress: bool = True) -> list[RequestOutcome]:
    """Closed loop: ``cfg.concurrency`` clients each send the next prompt when their last request
    ended, until ``stop`` is set (or ``num_requests`` were sent). Round-robins over ``urls``; a
    connection refused (nothing sent: the gateway is down) goes to the next one, as a client with
    several endpoints, or a load balancer, does."""
    texts = prompts(cfg.num_prompts)
    start = time.monotonic()
    outcomes: list[RequestOutcome] = []
    counter = itertools.count()
    bar = tqdm(desc=label, unit="req", disable=not progress, leave=False, total=num_requests)
    timeout = aiohttp.ClientTimeout(total=None)  # the deadline below bounds each request

    async def client(session: aiohttp.ClientSession) -> None:
        while not stop.is_set() and (num_requests is None or len(outcomes) < num_requests):
            i = next(counter)
            outcome = RequestOutcome(i, i % len(texts), round(time.monotonic() - start, 3))
            outcomes.append(outcome)
            body = {"model": cfg.model, "prompt": texts[outcome.prompt_index], "max_tokens": cfg.max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": True}
            try:
                await asyncio.wait_for(_failing_over(session, urls, i, body, outcome, start), cfg.deadline_s)
            except TimeoutError:
                continue  # hung: no end recorded
            outcome.ended_s = round(time.monotonic() - start, 3)
            bar.update(1)
            bar.set_postfix(failed=sum(o.error is not None for o in outcomes), refresh=False)

    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            await asyncio.gather(*(client(session) for _ in range(cfg.concurrency)))
    finally:
        bar.close()
    return outcomes


def base_urls(stack: Stack) -> list[str]:
    return list(stack.base_urls)


def reference_run(stack: Stack, cfg: ChaosConfig, progress: bool = True) -> dict[int, str]:
    """Each prompt's greedy output, fault-free; raises if any request of it did not succeed."""
    outcomes = asyncio.run(drive(base_urls(stack), cfg, asyncio.Event(), num_requests=cfg.num_prompts,
                                 label="reference", progress=progress))
    bad = [o for o in outcomes if o.ended_s is None or o.error is not None]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(outcomes)} requests of the fault-free reference run did not "
                           f"succeed (first: {bad[0]})")
    return {o.prompt_index: o.text for o in outcomes}


async def _phase(stack: Stack, cfg: ChaosConfig, fault: str, progress: bool) -> tuple[list, float, list[str]]:
    stop = asyncio.Event()
    start = time.monotonic()
    load = asyncio.create_task(drive(base_urls(stack), cfg, stop, label=fault, progress=progress))
    await asyncio.sleep(cfg.warm_s)  # the load runs warm before the fault
    fault_at_s = round(time.monotonic() - start, 3)
    notes = await asyncio.to_thread(inject, fault, stack, cfg.fault_options)
    await asyncio.sleep(cfg.after_s)
    stop.set()
    return await load, fault_at_s, notes


def recover(stack: Stack, cfg: ChaosConfig) -> None:
    """Until every child runs again and the gateway lists every worker as ready."""
    deadline = time.monotonic() + cfg.recover_timeout_s
    while dead := [n for n, c in stack.children.items() if not c.is_running()]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not running again after {cfg.recover_timeout_s:g}s: {', '.join(dead)}")
        time.sleep(0.2)
    stack.wait_ready(timeout_s=max(1.0, deadline - time.monotonic()))


def leaked_blocks(stack: Stack, timeout_s: float) -> dict[str, int]:
    """Worker id → KV blocks it still uses (held ones included) once idle; empty when every worker
    reports none within ``timeout_s``. Read from the gateway's /status, as ``tandem status`` does."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = {w["info"]["worker_id"]: (w.get("load") or {}).get("num_blocks_used", 0)
                for w in status(stack.base_url)["workers"]}
        if not any(used.values()) or time.monotonic() > deadline:
            return {w: n for w, n in used.items() if n}
        time.sleep(0.2)


def run_fault(stack: Stack, cfg: ChaosConfig, fault: str, reference: dict[int, str],
              progress: bool = True, record: dict[str, list[RequestOutcome]] | None = None) -> FaultReport:
    """One fault under load; ``record`` gets the phase's request outcomes under the fault's name."""
    if reason := skip_reason(fault, stack):
        return skipped_report(fault, reason)
    before = {name: stack.num_restarts(name) for name in stack.children}
    outcomes, fault_at_s, notes = asyncio.run(_phase(stack, cfg, fault, progress))
    if record is not None:
        record[fault] = outcomes
    try:
        recover(stack, cfg)
    except (RuntimeError, TimeoutError) as exc:
        notes.append(f"stack not whole again: {exc}")
        leaked = {}
    else:
        leaked = leaked_blocks(stack, cfg.idle_timeout_s)
    restarts = {name: stack.num_restarts(name) - before.get(name, 0) for name in stack.children}
    return fault_report(fault, outcomes, reference, fault_at_s=None if fault == "none" else fault_at_s,
                        leaked_blocks=leaked, restarts=restarts, notes=notes)


def run_drill(stack: Stack, cfg: ChaosConfig, progress: bool = True,
              record: dict[str, list[RequestOutcome]] | None = None) -> tuple[dict[int, str], list[FaultReport]]:
    """The reference run, then each fault in turn; a fault after which the stack did not become whole
    again ends the drill (the faults left are reported as skipped). ``record``: see ``run_fault``."""
    reference = reference_run(stack, cfg, progress)
    reports: list[FaultReport] = []
    for fault in cfg.faults:
        if reports and any(n.startswith("stack not whole") for n in reports[-1].notes):
            reports.append(skipped_report(fault, f"the stack did not recover from {reports[-1].fault}"))
            continue
        reports.append(run_fault(stack, cfg, fault, reference, progress, record))
        print(format_table(reports[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return reference, reports


def _request_json(outcome: RequestOutcome, reference: dict[int, str]) -> dict:
    """The outcome without its text where that is the reference's (it is in the JSON once)."""
    same = outcome.text == reference[outcome.prompt_index]
    return {**dataclasses.asdict(outcome), "text": None if same else outcome.text}


def parse_args(argv: list[str] | None) -> tuple[ChaosConfig, argparse.Namespace]:
    d = ChaosConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", type=int, default=d.num_decode, help="decode workers (default: %(default)s)")
    p.add_argument("--prefill", type=int, default=d.num_prefill, help="prefill workers (default: %(default)s)")
    p.add_argument("--gateways", type=int, default=d.num_gateways,
                   help="gateways (default: %(default)s; kill-gateway needs 2)")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="clients (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="distinct prompts (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per request (default: %(default)s)")
    p.add_argument("--faults", default=",".join(d.faults),
                   help=f"comma-separated, run in this order (default: all): {', '.join(FAULTS)}")
    p.add_argument("--warm-s", type=float, default=d.warm_s, help="load before each fault (default: %(default)s)")
    p.add_argument("--after-s", type=float, default=d.after_s, help="load after each fault (default: %(default)s)")
    p.add_argument("--deadline-s", type=float, default=d.deadline_s,
                   help="per request; not ended by then counts as hung (default: %(default)s)")
    p.add_argument("--stop-s", type=float, default=d.fault_options.stop_s,
                   help="how long stop-decode keeps the worker stopped (default: %(default)s)")
    p.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s,
                   help="after a fault, how long idle workers may take to free their blocks (default: %(default)s)")
    p.add_argument("--model", default=d.model)
    p.add_argument("--device", default=d.device)
    p.add_argument("--kv-cache-memory", default=d.kv_cache_memory)
    p.add_argument("--dtype", default=d.dtype, help="workers' dtype, or auto for their automatic precision (int8 on "
                   "a VNNI CPU); a moved request must repeat the reference's tokens in either (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/chaos"))
    p.add_argument("--name", default="chaos", help="output file name stem (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--replot", type=Path, metavar="JSON",
                   help="run nothing: print the table of an earlier run's JSON and write its plot beside it")
    args = p.parse_args(argv)
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    if unknown := [f for f in faults if f not in FAULTS]:
        p.error(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    cfg = ChaosConfig(faults=faults, num_decode=args.decode, num_prefill=args.prefill, num_gateways=args.gateways,
                      concurrency=args.concurrency, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                      warm_s=args.warm_s, after_s=args.after_s, deadline_s=args.deadline_s,
                      idle_timeout_s=args.idle_timeout_s, model=args.model, device=args.device,
                      kv_cache_memory=args.kv_cache_memory, dtype=None if args.dtype == "auto" else args.dtype,
                      fault_options=FaultOptions(stop_s=args.stop_s))
    return cfg, args


def replot(json_path: Path) -> int:
    reports = [report_from_json(f) for f in json.loads(json_path.read_text())["faults"]]
    print(format_table(reports))
    print(format_totals(totals(reports)))
    print("wrote", plot(reports, json_path.with_suffix(".png")))
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    if args.replot:
        return replot(args.replot)
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / f"{args.name}_stack.log", "w", buffering=1)  # noqa: SIM115 — closed after the stack
    with tempfile.TemporaryDirectory() as state:
        stack = Stack(stack_spec(cfg, Path(state)), on_line=lambda name, line: log.write(f"{name:<12}| {line}\n"))
        try:
            stack.start()
            stack.wait_ready(timeout_s=cfg.recover_timeout_s)
            started = time.time()
            record: dict[str, list[RequestOutcome]] = {}
            reference, reports = run_drill(stack, cfg, progress=not args.no_progress, record=record)
        finally:
            stack.stop()
            log.close()
    summary = totals(reports)
    print(format_table(reports))
    print(format_totals(summary))
    config = {**dataclasses.asdict(cfg), "cpu_count": os.cpu_count(), "started": started,
              "load_average_1m_after": os.getloadavg()[0]}
    json_path = args.out / f"{args.name}.json"
    json_path.write_text(json.dumps({"config": config, "summary": summary, "reference": reference,
                                     "faults": [r.to_json() for r in reports],
                                     "requests": {f: [_request_json(o, reference) for o in outcomes]
                                                  for f, outcomes in record.items()}}, indent=1))
    print("wrote", json_path, plot(reports, args.out / f"{args.name}.png"))
    return 0 if summary["num_clean"] == summary["num_faults"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
