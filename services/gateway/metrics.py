"""The gateway's metrics: Prometheus families (served on ``/metrics`` of the API port and of the
metrics port) and the recent history the dashboard draws (``shared.telemetry.series``).

Every observation goes through a method here, so the two never disagree. Latencies in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.telemetry.metrics import LATENCY_BUCKETS_S, service_registry
from shared.telemetry.series import RecentSeries


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.series = RecentSeries()
        self.num_in_flight = 0
        self.online_ended_at = float("-inf")  # time.monotonic() when the last HTTP generation ended
        self.num_batch_lines = 0  # batch lines this gateway's runner runs now (not in num_in_flight)
        self._clock = clock
        r = self.registry
        self.requests = Counter("tandem_gateway_requests", "HTTP responses of /v1/ routes by status",
                                ["status"], registry=r)
        self.in_flight = Gauge("tandem_gateway_in_flight", "generation requests in flight", registry=r)
        self.batch_lines = Gauge("tandem_gateway_batch_lines_in_flight", "batch lines this gateway runs now",
                                 registry=r)
        self.generated = Counter("tandem_gateway_generated_tokens", "completion tokens sent", registry=r)
        self.rejected = Counter("tandem_gateway_rejected", "requests rejected by admission, by its reason",
                                ["reason", "tier"], registry=r)
        self.admitted = Counter("tandem_gateway_admitted", "admissions to a decode worker (a migrated "
                                "request counts again)", ["tier"], registry=r)
        self.worker_errors = Counter("tandem_gateway_worker_errors", "protocol violations by decode "
                                     "workers (malformed_chunk, early_end, timeout), by worker and reason",
                                     ["worker", "reason"], registry=r)
        self.migrations = Counter("tandem_gateway_migrations", "requests continued on another worker "
                                  "after losing theirs", registry=r)
        self.ttft = Histogram("tandem_gateway_ttft_seconds", "time to first token", ["tier"],
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("tandem_gateway_itl_seconds", "inter-token latency", buckets=LATENCY_BUCKETS_S,
                             registry=r)
        self.e2e = Histogram("tandem_gateway_e2e_seconds", "request start to last token", ["tier"],
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.phases = Histogram("tandem_request_phase_seconds", "time to first token by phase",
                                ["phase"], buckets=LATENCY_BUCKETS_S, registry=r)

    @classmethod
    def create(cls, num_restarts: int = 0, instance: str = "gateway") -> GatewayMetrics:
        """With the process-wide families of every service (``service_registry``)."""
        return cls(service_registry("gateway", instance, num_restarts))

    def observe_started(self) -> None:
        self.num_in_flight += 1
        self.in_flight.inc()

    def observe_ended(self) -> None:
        self.num_in_flight -= 1
        self.in_flight.dec()
        self.online_ended_at = time.monotonic()

    def observe_batch_lines(self, num_running: int) -> None:
        self.num_batch_lines = num_running
        self.batch_lines.set(num_running)

    def observe_ttft(self, seconds: float, tier: str) -> None:
        self.ttft.labels(tier=tier).observe(seconds)
        self.series.observe_ttft(self._clock(), seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.series.observe_itl(self._clock(), seconds)

    def observe_finished(self, seconds: float, tier: str, num_tokens: int) -> None:
        """A request that got its first token ended (finished, failed or cut off)."""
        self.e2e.labels(tier=tier).observe(seconds)
        self.generated.inc(num_tokens)
        self.series.observe_finished(self._clock(), num_tokens)

    def observe_phases(self, phases: Mapping[str, float]) -> None:
        """One request's time to first token split into phases (seconds, by phase name)."""
        for phase, seconds in phases.items():
            self.phases.labels(phase=phase).observe(seconds)

    def observe_admitted(self, tier: str) -> None:
        self.admitted.labels(tier=tier).inc()

    def observe_rejected(self, tier: str, reason: str) -> None:
        self.rejected.labels(reason=reason, tier=tier).inc()
        self.series.observe_rejected(self._clock(), tier)

    def observe_worker_error(self, worker_id: str, reason: str) -> None:
        self.worker_errors.labels(worker=worker_id, reason=reason).inc()

    def observe_migration(self) -> None:
        self.migrations.inc()

    def observe_response(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()
