"""What recording metrics costs per request, per token and per engine step, and what a scrape costs.

    python -m loadtest.bench.metrics [--num-requests 2000 --output-tokens 128] [--out loadtest/results]

Metrics cannot be switched off (every service records into its registry whether or not anyone
scrapes it), so there is no on/off run to compare: this times the recording calls the services
make, on the objects they use, and relates them to a request's own latencies. Writes
``metrics/bench_metrics.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

from services.gateway.metrics import GatewayMetrics
from shared.engine.engine import EngineStats
from shared.protocol.workers import WorkerLoad
from services.worker.metrics import WorkerMetrics
from shared.telemetry.families import AdmissionMetrics
from shared.telemetry.metrics import exposition, service_registry
from shared.transfer.base import TransferStats

PHASES = {"gateway": 0.001, "admission": 0.002, "queue": 0.01, "prefill": 0.2, "transfer": 0.01,
          "first_step": 0.03}


def per_call_us(fn: Callable[[int], None], repeats: int) -> float:
    """Microseconds per call of ``fn(i)``, best of three runs of ``repeats`` calls."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for i in range(repeats):
            fn(i)
        best = min(best, (time.perf_counter() - started) / repeats)
    return best * 1e6


def gateway_request(m: GatewayMetrics, num_tokens: int) -> Callable[[int], None]:
    """Every call the gateway makes for one streamed request of ``num_tokens`` tokens."""
    def one(i: int) -> None:
        m.observe_started()
        m.observe_admitted("default")
        m.observe_ttft(0.05 + (i % 50) * 0.01, "default")
        m.observe_phases(PHASES)
        for t in range(num_tokens - 1):
            m.observe_itl(0.02 + (t % 7) * 0.001)
        m.observe_finished(1.5, "default", num_tokens)
        m.observe_ended()
        m.observe_response(200)
    return one


def gateway_before_first_token(m: GatewayMetrics) -> Callable[[int], None]:
    """The calls made before a request's first token is sent (what could add to TTFT)."""
    def one(i: int) -> None:
        m.observe_started()
        m.observe_admitted("default")
        m.observe_ttft(0.05 + (i % 50) * 0.01, "default")
        m.observe_phases(PHASES)
    return one


def worker_metrics() -> WorkerMetrics:
    m = WorkerMetrics(service_registry("decode", "w", 0))
    stats = EngineStats(8, 2, 4096, 1200, 300, 64, 0, 10_000, 500_000, 120_000, 80_000)
    m.bind(lambda: stats, lambda: TransferStats(num_bytes_received=1 << 30), lambda: 0)
    m.observe_load(WorkerLoad(worker_id="w", role="decode", seq=1, timestamp=0.0, num_requests_total=100), "ready")
    return m


def scrape_ms(registry, repeats: int = 200) -> tuple[float, int]:
    body = exposition(registry)[0]
    return per_call_us(lambda i: exposition(registry), repeats) / 1000, len(body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args(argv)
    gateway, worker, admission = GatewayMetrics.create(), worker_metrics(), AdmissionMetrics.create("a", 0)
    n, tokens = args.num_requests, args.output_tokens
    result = {
        "output_tokens_per_request": tokens,
        "gateway_per_request_us": per_call_us(gateway_request(gateway, tokens), max(1, n // 10)),
        "gateway_before_first_token_us": per_call_us(gateway_before_first_token(gateway), n),
        "gateway_per_token_us": per_call_us(lambda i: gateway.observe_itl(0.02), n * 10),
        "worker_per_token_us": per_call_us(lambda i: worker.itl.observe(0.02), n * 10),
        "worker_per_step_us": per_call_us(lambda i: worker.observe_step(8, 8, 0.02), n * 10),
        "admission_per_request_us": per_call_us(
            lambda i: admission.observe_decision("default", None, 0.001, 0.3), n * 10),
    }
    for name, registry in (("gateway", gateway.registry), ("worker", worker.registry),
                           ("admission", admission.registry)):
        ms, size = scrape_ms(registry)
        result[f"{name}_scrape_ms"], result[f"{name}_scrape_bytes"] = ms, size
    out = args.out / "metrics"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_metrics.json").write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result.items():
        print(f"{key:<28} {value:10.2f}" if isinstance(value, float) else f"{key:<28} {value:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
