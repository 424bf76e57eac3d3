"""The Prometheus families of admission, kv-index and the autoscaler (the gateway's are in
``services.gateway.metrics``, a worker's in ``services.worker.metrics``). Each class owns one
registry; its ``create`` adds what every service exports (``service_registry``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from shared.protocol.workers import ScalingAction, ScalingDecisionRecord, WorkerStatus
from shared.telemetry.metrics import LATENCY_BUCKETS_S, STEP_BUCKETS_S, CallbackCollector, service_registry


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.decisions = Counter("tandem_admission_decisions", "admission decisions by tier, outcome and "
                                 "reason (admitted: reason admitted)", ["tier", "decision", "reason"], registry=r)
        self.latency = Histogram("tandem_admission_decision_seconds", "time to decide one request (kv-index "
                                 "match included)", buckets=STEP_BUCKETS_S, registry=r)
        self.predicted_ttft = Histogram("tandem_admission_predicted_ttft_seconds", "TTFT admission predicted "
                                        "for the requests it admitted", ["tier"], buckets=LATENCY_BUCKETS_S,
                                        registry=r)
        self.kvindex_failures = Counter("tandem_admission_kvindex_failures", "kv-index match requests that "
                                        "failed (routed on load alone)", registry=r)
        self.ready_workers = Gauge("tandem_admission_ready_decode_workers", "ready decode workers admission "
                                   "routes to", registry=r)
        self.admitted_elsewhere = Counter("tandem_admission_admitted_elsewhere", "requests predicted to miss "
                                          "their SLO on the routing's choice and admitted on another worker",
                                          registry=r)

    @classmethod
    def create(cls, instance: str, num_restarts: int) -> AdmissionMetrics:
        return cls(service_registry("admission", instance, num_restarts))

    def observe_decision(self, tier: str, reason: str | None, seconds: float,
                         predicted_ttft_s: float | None = None) -> None:
        """``reason``: None when admitted, else the reject code."""
        self.decisions.labels(tier=tier, decision="rejected" if reason else "admitted",
                              reason=reason or "admitted").inc()
        self.latency.observe(seconds)
        if reason is None and predicted_ttft_s is not None:
            self.predicted_ttft.labels(tier=tier).observe(predicted_ttft_s)


class KvIndexMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.batches = Counter("tandem_kvindex_event_batches", "KV event batches applied", registry=r)
        self.events = Counter("tandem_kvindex_events", "KV events applied", registry=r)
        self.gaps = Counter("tandem_kvindex_event_gaps", "batches whose first seq did not follow the worker's "
                            "last one", registry=r)
        self.matches = Counter("tandem_kvindex_matches", "prefix match queries answered", registry=r)
        self.match_latency = Histogram("tandem_kvindex_match_seconds", "time to answer one match query",
                                       buckets=STEP_BUCKETS_S, registry=r)
        self.matched_blocks = Counter("tandem_kvindex_matched_blocks", "leading blocks found (best worker) "
                                      "over all queries", registry=r)
        self.queried_blocks = Counter("tandem_kvindex_queried_blocks", "blocks asked about over all queries",
                                      registry=r)
        self.dropped_workers = Counter("tandem_kvindex_dropped_workers", "workers dropped from the index after "
                                       "leaving the registry", registry=r)

    @classmethod
    def create(cls, instance: str, num_restarts: int) -> KvIndexMetrics:
        return cls(service_registry("kv-index", instance, num_restarts))


class AutoscalerMetrics:
    """The cluster as the autoscaler sees it (workers by role and state, the prefill queue) and
    what it decided and did."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.queue_depth = Gauge("tandem_prefill_queue_depth", "requests waiting in the prefill queue, by "
                                 "priority level", ["level"], registry=r)
        self.queue_in_progress = Gauge("tandem_prefill_queue_in_progress", "prefill-queue requests taken by a "
                                       "prefill worker and not yet acknowledged", registry=r)
        self.queue_redelivered = Gauge("tandem_prefill_queue_redelivered", "prefill-queue requests delivered "
                                       "more than once and not yet acknowledged", registry=r)
        self.ticks = Counter("tandem_autoscaler_ticks", "autoscaling decisions made (acting or not)", registry=r)
        self.actions = Counter("tandem_autoscaler_actions", "actions carried out for a decision",
                               ["kind", "role", "ok"], registry=r)
        self.target = Gauge("tandem_autoscaler_target_workers", "workers per role the latest decision wants",
                            ["role"], registry=r)

    @classmethod
    def create(cls, instance: str, num_restarts: int) -> AutoscalerMetrics:
        return cls(service_registry("autoscaler", instance, num_restarts))

    def bind(self, workers: Callable[[], list[WorkerStatus]]) -> None:
        """Count the cluster's workers at every scrape."""
        self.registry.register(CallbackCollector(lambda: _worker_counts(workers())))

    def observe_queue(self, num_pending_by_level: list[int], num_in_progress: int, num_redelivered: int) -> None:
        for level, n in enumerate(num_pending_by_level):
            self.queue_depth.labels(level=str(level)).set(n)
        self.queue_in_progress.set(num_in_progress)
        self.queue_redelivered.set(num_redelivered)

    def observe_decision(self, decision: ScalingDecisionRecord | None, actions: list[ScalingAction]) -> None:
        self.ticks.inc()
        if decision is not None:
            self.target.labels(role="prefill").set(decision.target_prefill)
            self.target.labels(role="decode").set(decision.target_decode)
        for a in actions:
            self.actions.labels(kind=a.kind, role=a.role, ok=str(a.ok).lower()).inc()


def _worker_counts(workers: list[WorkerStatus]) -> Iterable[Metric]:
    family = GaugeMetricFamily("tandem_cluster_workers", "registered workers by role and state",
                               labels=["role", "state"])
    counts: dict[tuple[str, str], int] = {}
    for w in workers:
        key = (w.info.role, w.info.state)
        counts[key] = counts.get(key, 0) + 1
    for (role, state), n in sorted(counts.items()):
        family.add_metric([role, state], n)
    yield family
