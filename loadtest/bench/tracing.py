"""Tracing's cost: two identical stacks (one decode worker each), one exporting every span over
OTLP/HTTP, the other with tracing off, same workload, in one run.

    python -m loadtest.bench.tracing [--num-requests 40 --rate 2 --repeats 2] [--out loadtest/results/tracing]
    python -m loadtest.bench.tracing --service-path [--num-requests 200 --repeats 4]

Both stacks are started and warmed up first, then measured alternately ``--repeats`` times (the
other idles meanwhile); the best repeat of each side is kept, which damps interference from other
work on the machine. The traced stack exports to a local OTLP/HTTP sink that answers at once
without decoding (a collector's own cost is not ours). Targets (issue 14): throughput >= 97% of
untraced, TTFT p50 within +2 ms. Writes ``tracing.json`` / ``tracing.png`` and both stacks' logs.

``--service-path``: the same comparison without the engine (``loadtest.bench.service_path``: the echo
worker answers at once, requests go one at a time), so the TTFT difference is what tracing adds
to the gateway, admission and kv-index, free of the model's compute and of queueing; alternating
blocks of ``num_requests / repeats`` requests. Writes ``tracing_service_path.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from loadtest.tools.harness import alternate, log_to, report_comparison, stack_side, take_turns, warm_up
from loadtest.tools.openai_load import add_workload_args, comparison_workload
from loadtest.tools.workload import build_workload

TARGETS = {"throughput_ratio_min": 0.97, "added_ttft_p50_ms_max": 2.0}


class OtlpSink:
    """Accepts OTLP/HTTP exports and counts them."""

    def __init__(self) -> None:
        self.num_exports = self.num_bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                sink.num_bytes += len(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                sink.num_exports += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """``values`` in this process's environment (which the stack's children inherit at spawn)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compare(on: dict, off: dict) -> dict:
    ratio = on["output_token_throughput"] / off["output_token_throughput"]
    added_ttft = (on["ttft_s"]["p50"] - off["ttft_s"]["p50"]) * 1000
    return {"throughput_ratio": ratio, "added_ttft_p50_ms": added_ttft,
            "added_itl_p50_ms": (on["itl_s"]["p50"] - off["itl_s"]["p50"]) * 1000, "targets": TARGETS,
            "meets_targets": ratio >= TARGETS["throughput_ratio_min"]
            and added_ttft <= TARGETS["added_ttft_p50_ms_max"]}


def start_stack(name: str, args, state: str, log_file):
    from services.stack.stack import Stack, StackSpec  # noqa: PLC0415 — torch

    stack = Stack(StackSpec(state_dir=Path(state) / name, num_decode=1, model=args.model, port=0,
                            namespace=f"{name}{os.getpid()}",
                            decode_flags={"device": "cpu", "kv_cache_memory": args.kv_cache_memory}),
                  on_line=log_to(log_file))
    stack.start()
    return stack


def start_echo_stack(name: str, args, state: str, log_file):
    """A stack without engine: the echo worker as its decode worker."""
    from loadtest.bench.service_path import add_echo_worker  # noqa: PLC0415
    from services.stack.stack import Stack, StackSpec  # noqa: PLC0415

    stack = Stack(StackSpec(state_dir=Path(state) / name, num_decode=0, model=args.model, port=0,
                            namespace=f"{name}{os.getpid()}"),
                  on_line=log_to(log_file))
    stack.start()
    add_echo_worker(stack, args.model, log_to(log_file))
    return stack


@contextlib.contextmanager
def stack_pair(start, names: tuple[str, str], args, log_name: str, traced_env: dict[str, str]):
    """``{"on": ..., "off": ...}``: two stacks from ``start(name, args, state, log)``, the first
    started with ``traced_env`` in its environment; both log to ``--out``/``log_name`` and are
    stopped on exit."""
    stacks = {}
    with open(args.out / log_name, "w") as log, tempfile.TemporaryDirectory() as state:
        try:
            with environment(traced_env):
                stacks["on"] = start(names[0], args, state, log)
            stacks["off"] = start(names[1], args, state, log)
            yield stacks
        finally:
            for stack in stacks.values():
                stack.stop()


def service_path(args, sink: OtlpSink, traced_env: dict[str, str]) -> int:
    from loadtest.bench.service_path import measure  # noqa: PLC0415
    from shared.telemetry.measure import percentile  # noqa: PLC0415
    from loadtest.tools.workload import WorkloadConfig  # noqa: PLC0415

    prompts = [s.prompt for s in build_workload(WorkloadConfig(num_requests=args.num_requests + 10,
                                                               prompt_words=64))]
    block = max(1, args.num_requests // args.repeats)
    starts = range(10, 10 + args.num_requests, block)
    with stack_pair(start_echo_stack, ("ptraced", "puntraced"), args, "tracing_service_path_stacks.log",
                    traced_env) as stacks:
        for stack in stacks.values():
            stack.wait_ready(timeout_s=120, num_decode=1)
            asyncio.run(measure(stack.base_url, args.model, prompts[:10]))

        def block_on(url: str):
            return lambda i: asyncio.run(measure(url, args.model, prompts[starts[i]:starts[i] + block]))

        blocks = take_turns({side: block_on(stacks[side].base_url) for side in ("on", "off")}, len(starts))
    ttfts = {side: [t for b in bs for t in b] for side, bs in blocks.items()}
    p50 = {side: percentile(v, 50) * 1000 for side, v in ttfts.items()}
    result = {"num_requests_per_side": len(ttfts["on"]), "block": block, "cpu_count": os.cpu_count(),
              "load_average_1m": os.getloadavg()[0], "otlp_exports": sink.num_exports, "otlp_bytes": sink.num_bytes,
              **{f"ttft_ms_p{q}_{side}": percentile(v, q) * 1000 for side, v in ttfts.items() for q in (50, 90)},
              "added_ttft_p50_ms": p50["on"] - p50["off"],
              "meets_ttft_target": p50["on"] - p50["off"] <= TARGETS["added_ttft_p50_ms_max"]}
    (args.out / "tracing_service_path.json").write_text(json.dumps(result, indent=2))
    print(f"service path TTFT p50 traced {p50['on']:.2f} ms, untraced {p50['off']:.2f} ms: "
          f"{result['added_ttft_p50_ms']:+.2f} ms ({sink.num_exports} OTLP exports)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--service-path", action="store_true", help="engine excluded (echo worker), one request at a time")
    add_workload_args(p)
    p.set_defaults(num_requests=40, rate=2.0, out=Path("loadtest/results/tracing"))
    args = p.parse_args(argv)
    cfg, specs, warmup, slo = comparison_workload(args)
    sink = OtlpSink()
    traced_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    if args.service_path:
        return service_path(args, sink, traced_env)
    with stack_pair(start_stack, ("traced", "untraced"), args, "tracing_stacks.log", traced_env) as stacks:
        sides = {side: stack_side(stacks[side], args.model) for side in ("on", "off")}
        warm_up(sides, warmup)
        runs = alternate(sides, specs, args.repeats, slo, progress=not args.no_progress)

    report_comparison(args.out, "tracing", {"workload": dataclasses.asdict(cfg), "model": args.model,
                                            "kv_cache_memory": args.kv_cache_memory}, runs, compare,
                      {"on": ("tracing on ", "tracing on (OTLP/HTTP)"), "off": ("tracing off", "tracing off")},
                      detail=lambda result: f" ({sink.num_exports} OTLP exports, {sink.num_bytes} bytes)",
                      otlp_exports=sink.num_exports, otlp_bytes=sink.num_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
