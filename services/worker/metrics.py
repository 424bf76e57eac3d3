"""A worker process's Prometheus families (decode and prefill roles alike).

Three sources, each read where it is cheapest:
- the engine's own counters and gauges (KV blocks, running/waiting, tokens), read at scrape time
  from ``EngineStats``; and every model step's batch size and duration, pushed by the engine
  thread (``AsyncEngine.add_step_observer``);
- the role's counters (requests, local/remote prefills, drops) from its latest load report, which
  the process publishes about once a second anyway; a role flip starts them again from zero, which
  Prometheus reads as a counter reset;
- latencies the roles observe as they happen (TTFT and ITL at the worker, prefill-queue wait,
  prefill compute, each KV write).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shared.engine.engine import EngineStats
from shared.protocol.workers import WorkerLoad
from shared.telemetry.metrics import (BATCH_BUCKETS, LATENCY_BUCKETS_S, STEP_BUCKETS_S, CallbackCollector,
                                      service_registry)
from shared.transfer.base import TransferStats


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("tandem_worker_ttft_seconds", "decode: request arrival to its first token here",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("tandem_worker_itl_seconds", "decode: time between two tokens of a request",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.step = Histogram("tandem_engine_step_seconds", "one model step (forward and sampling)",
                              buckets=STEP_BUCKETS_S, registry=r)
        self.batch_size = Histogram("tandem_engine_batch_size", "sequences in one model step",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_tokens = Histogram("tandem_engine_batch_tokens", "tokens in one model step",
                                      buckets=(1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192), registry=r)
        self.queue_wait = Histogram("tandem_prefill_queue_wait_seconds", "prefill: a request's wait in the "
                                    "prefill queue (published to pulled)", buckets=LATENCY_BUCKETS_S, registry=r)
        self.prefill = Histogram("tandem_prefill_compute_seconds", "prefill: computing one prompt's KV",
                                 buckets=LATENCY_BUCKETS_S, registry=r)
        self.kv_write = Histogram("tandem_kv_transfer_seconds", "prefill: one KV write into a decode worker, "
                                  "start to completion", buckets=STEP_BUCKETS_S + (5.0, 10.0), registry=r)
        self._load: WorkerLoad | None = None
        self._state: tuple[str, str] | None = None

    @classmethod
    def create(cls, service: str, instance: str, num_restarts: int) -> WorkerMetrics:
        """``service``: the role the process started as; ``instance``: its worker id."""
        return cls(service_registry(service, instance, num_restarts))

    def bind(self, engine_stats: Callable[[], EngineStats],
             transfer_stats: Callable[[], TransferStats | None], num_flips: Callable[[], int]) -> None:
        """Read these at every scrape (the engine's and the KV transfer's counters)."""
        self.registry.register(CallbackCollector(
            lambda: _scraped(engine_stats(), transfer_stats(), num_flips(), self._load, self._state)))

    def observe_step(self, num_seqs: int, num_tokens: int, elapsed_s: float) -> None:
        """A ``StepObserver``: runs in the engine thread."""
        self.step.observe(elapsed_s)
        self.batch_size.observe(num_seqs)
        self.batch_tokens.observe(num_tokens)

    def observe_load(self, load: WorkerLoad, state: str) -> None:
        self._load = load
        self._state = (load.role, state)


def _scraped(stats: EngineStats, transfer: TransferStats | None, num_flips: int, load: WorkerLoad | None,
             state: tuple[str, str] | None) -> Iterable[Metric]:
    yield from _engine_families(stats)
    if state is not None:
        info = GaugeMetricFamily("tandem_worker_info", "the worker's current role and state (always 1)",
                                 labels=["role", "state"])
        info.add_metric(list(state), 1)
        yield info
    yield CounterMetricFamily("tandem_worker_role_flips", "role flips (decode <-> prefill) of this process",
                              value=num_flips)
    if load is not None:
        yield from _role_families(load)
    if transfer is not None:
        kv_bytes = CounterMetricFamily("tandem_kv_transfer_bytes", "KV bytes moved by NIXL", labels=["direction"])
        kv_bytes.add_metric(["sent"], transfer.num_bytes_sent)
        kv_bytes.add_metric(["received"], transfer.num_bytes_received)
        yield kv_bytes
        yield CounterMetricFamily("tandem_kv_transfers", "completed KV writes from this process",
                                  value=transfer.num_transfers)
        yield CounterMetricFamily("tandem_kv_transfer_failures", "failed KV writes", value=transfer.num_failed)


def _engine_families(stats: EngineStats) -> Iterable[Metric]:
    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, value=value)

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, value=value)

    total = stats.num_blocks_total
    yield gauge("tandem_worker_kv_cache_usage_ratio", "KV blocks in use / KV blocks",
                stats.num_blocks_used / total if total else 0.0)
    yield gauge("tandem_worker_kv_blocks_used", "KV blocks held by requests", stats.num_blocks_used)
    yield gauge("tandem_worker_kv_blocks_cached", "free KV blocks still holding a reusable prefix",
                stats.num_cached_blocks)
    yield gauge("tandem_worker_kv_blocks_total", "KV blocks in the pool", total)
    yield gauge("tandem_worker_running_requests", "requests in the running batch", stats.num_running)
    yield gauge("tandem_worker_waiting_requests", "requests waiting for a slot or blocks", stats.num_waiting)
    yield gauge("tandem_worker_prefix_hit_ratio", "prompt tokens served from the prefix cache / prompt tokens",
                stats.num_cached_prompt_tokens / stats.num_prompt_tokens if stats.num_prompt_tokens else 0.0)
    yield counter("tandem_worker_prompt_tokens", "prompt tokens prefilled or found cached", stats.num_prompt_tokens)
    yield counter("tandem_worker_cached_prompt_tokens", "prompt tokens found in the prefix cache",
                  stats.num_cached_prompt_tokens)
    yield counter("tandem_worker_generated_tokens", "tokens sampled", stats.num_generated_tokens)
    yield counter("tandem_worker_preemptions", "requests preempted: for lack of KV blocks, or their slot taken by a request of higher priority", stats.num_preemptions)
    yield counter("tandem_engine_steps", "model steps", stats.num_steps)
    if stats.num_draft_tokens:
        yield counter("tandem_worker_spec_draft_tokens", "speculative decoding: draft tokens verified",
                      stats.num_draft_tokens)
        yield counter("tandem_worker_spec_accepted_tokens", "speculative decoding: draft tokens accepted",
                      stats.num_accepted_tokens)
    if stats.expert_tokens:
        experts = CounterMetricFamily("tandem_worker_expert_tokens", "a mixture of experts: (token, expert) pairs "
                                      "each expert took, summed over this process's layers", labels=["expert"])
        for expert, tokens in enumerate(stats.expert_tokens):
            experts.add_metric([str(expert)], tokens)
        yield experts
        yield gauge("tandem_worker_expert_imbalance", "a mixture of experts: the worst layer's busiest expert's "
                    "tokens over that layer's mean (1: even)", stats.expert_imbalance or 1.0)
    if tiers := stats.kv_tiers:
        blocks = GaugeMetricFamily("tandem_worker_kv_tier_blocks", "KV blocks held in a tier under the pool",
                                   labels=["tier"])
        offloads = CounterMetricFamily("tandem_worker_kv_tier_offloads", "KV blocks copied into a tier",
                                       labels=["tier"])
        onboards = CounterMetricFamily("tandem_worker_kv_tier_onboards", "KV blocks copied back into the pool "
                                       "on a prefix hit, by the tier they came from", labels=["tier"])
        for tier in ("host", "disk"):
            blocks.add_metric([tier], tiers[f"{tier}_blocks"])
            offloads.add_metric([tier], tiers[f"offloaded_{tier}"])
        onboards.add_metric(["host"], tiers["onboarded"] - tiers["onboarded_disk"])
        onboards.add_metric(["disk"], tiers["onboarded_disk"])
        yield from (blocks, offloads, onboards)
        yield counter("tandem_worker_kv_disk_read_failures", "damaged or mismatched KV blocks on disk "
                      "(recomputed)", tiers["disk_read_failures"])
        yield counter("tandem_worker_kv_offload_seconds", "engine-thread time spent copying evicted blocks "
                      "out of the pool", tiers["offload_seconds"])


def _role_families(load: WorkerLoad) -> Iterable[Metric]:
    requests = CounterMetricFamily("tandem_worker_requests", "requests this role took (as of its latest load "
                                   "report)", labels=["role"])
    requests.add_metric([load.role], load.num_requests_total)
    yield requests
    yield CounterMetricFamily("tandem_worker_aborted_requests", "requests cancelled or cut off",
                              value=load.num_requests_aborted)
    prefills = CounterMetricFamily("tandem_worker_prefills", "decode: prompts prefilled here (local), by a "
                                   "prefill worker (remote) or here after a remote attempt failed (fallback); "
                                   "prefill: prompts written (remote) or dropped", labels=["kind"])
    kinds = {"remote": load.num_remote_prefills, "local": load.num_local_prefills,
             "fallback": load.num_prefill_fallbacks, "dropped": load.num_prefills_dropped}
    for kind, n in kinds.items():
        prefills.add_metric([kind], n)
    yield prefills
    if (fetch := load.kv_fetch) is not None:
        fetches = CounterMetricFamily("tandem_worker_kv_peer_fetches", "prefix fetches from other workers: those "
                                      "that brought blocks (ok), asked but got none (failed: computed instead), "
                                      "and hints not taken (skipped)", labels=["result"])
        for result, n in (("ok", fetch.num_fetches), ("failed", fetch.num_failed), ("skipped", fetch.num_skipped)):
            fetches.add_metric([result], n)
        blocks = CounterMetricFamily("tandem_worker_kv_peer_blocks", "KV blocks fetched from or lent to other "
                                     "workers", labels=["direction"])
        blocks.add_metric(["fetched"], fetch.num_blocks_fetched)
        blocks.add_metric(["lent"], fetch.num_blocks_lent)
        yield from (fetches, blocks)
