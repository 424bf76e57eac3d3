"""The gateway's Prometheus metrics, served on ``/metrics``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.telemetry.metrics import LATENCY_BUCKETS_S, Counter, Gauge, Histogram, Registry


@dataclass
class GatewayMetrics:
    registry: Registry
    requests: Counter     # by HTTP status, /v1/ routes only
    in_flight: Gauge
    generated: Counter
    rejected: Counter     # by admission's reject reason and the request's tier
    admitted: Counter     # by tier (each admission: a migrated request counts again)
    ttft: Histogram
    itl: Histogram
    migrations: Counter
    phases: dict[str, Histogram] = field(default_factory=dict)  # TTFT phase → its histogram

    def observe_phases(self, phases: Mapping[str, float]) -> None:
        """One request's TTFT phases (seconds), each into its own histogram."""
        for name, seconds in phases.items():
            if name not in self.phases:
                self.phases[name] = self.registry.add(Histogram(
                    f"tandem_gateway_ttft_phase_{name}_seconds", f"time to first token spent in {name}",
                    LATENCY_BUCKETS_S))
            self.phases[name].observe(seconds)

    @classmethod
    def create(cls) -> GatewayMetrics:
        m = Registry()
        return cls(
            registry=m,
            requests=m.add(Counter("tandem_gateway_requests_total", "HTTP requests by status")),
            in_flight=m.add(Gauge("tandem_gateway_in_flight", "generation requests in flight")),
            rejected=m.add(Counter("tandem_gateway_rejected_total", "requests rejected by admission")),
            admitted=m.add(Counter("tandem_gateway_admitted_total", "requests admitted to a decode worker")),
            ttft=m.add(Histogram("tandem_gateway_ttft_seconds", "time to first token", LATENCY_BUCKETS_S)),
            itl=m.add(Histogram("tandem_gateway_itl_seconds", "inter-token latency", LATENCY_BUCKETS_S)),
            migrations=m.add(Counter("tandem_gateway_migrations_total",
                                     "requests continued on another worker after losing theirs")),
            generated=m.add(Counter("tandem_gateway_generated_tokens_total", "completion tokens")))
