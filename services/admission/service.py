"""admission: admit a request to a decode worker (KV overlap + load), or reject it early.

Per request: route (``shared.policy.kv_routing``: the cheapest worker by prefix overlap and load,
or with ``--routing round-robin`` the ready workers in turn),
then the tier rules (``shared.policy.admission.Admitter``: tier queue limit, shedding, predicted
TTFT against the tier's SLO) on that worker's observations: its reported prefill backlog by
priority and measured prefill rate, plus what was admitted to it since its last report, and the
rate at which it was sent higher-priority prompt tokens (``Inflow``: they will go first). Where the
request would miss its SLO there, the next cheapest workers (``--fallback-workers``) are tried before
it is rejected (``Admitter.decide_first``); a worker it goes to without the prefix may fetch it from
the holder (``kv_source``).
Rejects with ``unavailable`` when no ready decode worker serves the model, ``overloaded`` when
every one's queue is at the limit, or the Admitter's code. Asks kv-index for the prompt's prefix
overlap with a short timeout and routes on load alone when it does not answer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from shared.bus import Bus, ServiceError, WorkerRegistry
from shared.cluster.view import ClusterView, WorkerEntry
from shared.policy.admission import AdmissionConfig, AdmissionInput, Admitter, Inflow, Turnover, slot_wait_s
from shared.policy.kv_routing import (RoutingChoice, RoutingWeights, choose_worker, effective_overlap,
                                      next_cheapest_workers)
from shared.policy.qos import load_qos
from shared.policy.kv_fetch import FetchConfig, HeldPrefix, choose_kv_source
from shared.protocol import AdmissionDecision, GenerateRequest, KvMatchRequest, KvSource, Subjects, WorkerLoad
from services.framework.lifecycle import every, run_bus_service, service_instance_id
from shared.telemetry.families import AdmissionMetrics
from shared.telemetry.metrics import RecentMean
from services.admission.config import AdmissionSettings

log = logging.getLogger(__name__)


class AdmissionService:
    def __init__(self, settings: AdmissionSettings, bus: Bus, registry: WorkerRegistry) -> None:
        self._settings = settings
        self._subjects = Subjects(settings.namespace)
        self._bus = bus
        self._registry = registry
        self.view = ClusterView()
        self._weights = RoutingWeights(overlap_weight=settings.overlap_weight,
                                       queue_weight=settings.queue_weight,
                                       max_waiting_per_worker=settings.max_waiting_per_worker)
        self._fetch = FetchConfig(min_blocks=settings.min_fetch_blocks)
        self.qos = load_qos(settings.qos)
        self.admitter = Admitter(AdmissionConfig(self.qos, min_retry_after_s=settings.retry_after_s,
                                                 shed_hold_s=settings.shed_hold_s,
                                                 arrival_margin_sd=settings.arrival_margin_sd))
        self.inflow = Inflow()
        self.turnover = Turnover()
        # per worker, the max_tokens of the requests admitted to it in the last 30 s: how long the
        # answers may be while none has finished yet
        self._max_tokens: dict[str, RecentMean] = {}
        self._last_chosen = ""  # the worker id chosen last: round-robin's turn, kv routing's ties
        self.metrics = AdmissionMetrics.create(service_instance_id("admission"), settings.num_restarts)

    async def start(self) -> None:
        log.info("tiers: %s", ", ".join(f"{n} (priority {t.priority}, TTFT SLO {t.ttft_slo_ms or '-'} ms)"
                                        for n, t in self.qos.tiers.items()))
        await self.refresh()
        await self._bus.subscribe(self._subjects.load_all(), self.on_load)
        await self._bus.serve(self._subjects.admission_submit(), self.submit, queue="admission")

    async def refresh(self) -> None:
        self.view.set_workers(await self._registry.list())
        ready = {w.info.worker_id for w in self.view.ready_workers("decode")}
        self.inflow.forget(ready)
        self.turnover.forget(ready)
        for worker_id in [w for w in self._max_tokens if w not in ready]:
            del self._max_tokens[worker_id]
        self.metrics.ready_workers.set(len(self.view.ready_workers("decode")))

    async def run_forever(self) -> None:
        await every(self._settings.refresh_interval_s, self.refresh, "registry refresh")

    async def on_load(self, load: WorkerLoad) -> None:
        self.view.update_load(load, time.time())
        if load.role == "decode":
            self.turnover.note(load.worker_id, load.timestamp,
                               load.num_requests_total - load.num_running - load.num_waiting,
                               load.num_running + load.num_waiting >= load.max_num_seqs)

    async def submit(self, request: GenerateRequest) -> AdmissionDecision:
        started = time.monotonic()
        decision = await self._decide(request)
        rejected = None if decision.is_admitted else (decision.reject_reason or "unknown")
        self.metrics.observe_decision(self.qos.resolve(request.tier), rejected, time.monotonic() - started,
                                      decision.predicted_ttft_s)
        return decision

    async def _decide(self, request: GenerateRequest) -> AdmissionDecision:
        # kv-index first: a worker may leave the view while that is awaited, and from reading the
        # workers to the chosen one's entry nothing may await (else the chosen one can be gone)
        held = await self._held_prefixes(request)
        overlaps = {h.worker_id: effective_overlap(h.num_blocks, h.num_host_blocks, h.num_disk_blocks, self._weights)
                    for h in held}
        workers = self._candidates(request)
        if not workers:
            await self.refresh()  # a worker may have registered since the last refresh
            workers = self._candidates(request)
        if not workers:
            besides = f" besides {', '.join(request.exclude_workers)}" if request.exclude_workers else ""
            return self._reject(request, "unavailable", f"no ready decode worker serves {request.model!r}{besides}",
                                self._settings.retry_after_s)
        return self._route_and_admit(request, held, overlaps, workers)

    def _route_and_admit(self, request: GenerateRequest, held: list[HeldPrefix], overlaps: dict[str, float],
                         workers: list[WorkerEntry]) -> AdmissionDecision:
        """The routing's choice, or where the request would miss its SLO there the next cheapest workers,
        through the tier rules. Synchronous: nothing may await from reading ``workers`` to the chosen
        one's entry."""
        block_size = workers[0].info.block_size
        num_blocks = -(-len(request.prompt_token_ids) // block_size)  # ceil
        now = time.time()
        views = [w.load_view(now) for w in workers]
        first = choose_worker(views, overlaps, num_blocks, self._weights, now, self._last_chosen,
                              in_turn=self._settings.routing == "round-robin")
        if first.worker_id is None:
            return self._reject(request, "overloaded",
                                f"all {len(workers)} decode workers have "
                                f"{self._settings.max_waiting_per_worker}+ queued requests",
                                self._settings.retry_after_s)
        tried: list[tuple[RoutingChoice, WorkerEntry, AdmissionInput]] = []

        def ranked():  # the others are ranked only where the routing's choice misses (generators are lazy)
            yield first
            yield from next_cheapest_workers(views, overlaps, num_blocks, first.worker_id, self._weights, now,
                                             self._settings.fallback_workers)

        def candidates():
            for choice in ranked():
                entry = self.view.get(choice.worker_id)
                tried.append((choice, entry, self._observe(request, entry, workers, choice, now)))
                yield tried[-1][2]

        k, verdict = self.admitter.decide_first(candidates())
        ttft = verdict.predicted_ttft_s if verdict.predicted_ttft_s is not None and \
            math.isfinite(verdict.predicted_ttft_s) else None
        if not verdict.admitted:
            return self._reject(request, verdict.code, verdict.reason, verdict.retry_after_s, ttft)
        choice, entry, observed = tried[k]
        if k:
            self.metrics.admitted_elsewhere.inc()
            log.info("%s (tier %s): predicted to miss on %s, admitted on %s (predicted TTFT %s)", request.request_id,
                     observed.tier, first.worker_id, choice.worker_id, "?" if ttft is None else f"{ttft:.2f}s")
        log.debug("%s → %s (cost %.1f, overlap %d/%d blocks; predicted TTFT %s; overlaps %s; loads %s)",
                  request.request_id, choice.worker_id, choice.cost, choice.num_overlap_blocks, num_blocks,
                  "?" if ttft is None else f"{ttft:.3f}s", overlaps, views)
        self._note_admitted(request, choice, observed, num_blocks, now)
        return self._admitted(request, held, choice, entry, ttft)

    def _note_admitted(self, request: GenerateRequest, choice: RoutingChoice, observed: AdmissionInput,
                       num_blocks: int, now: float) -> None:
        """What later decisions see of this one: the chosen worker's new backlog, inflow and answer lengths."""
        priority = self.qos.tiers[observed.tier].priority
        self._last_chosen = choice.worker_id
        self.view.note_admitted(choice.worker_id, num_blocks - choice.num_overlap_blocks, time.time(), priority)
        self.inflow.note(choice.worker_id, now, priority, observed.prompt_tokens - observed.cached_tokens)
        self._max_tokens.setdefault(choice.worker_id, RecentMean(30.0)).observe(request.sampling.max_tokens, now)

    def _admitted(self, request: GenerateRequest, held: list[HeldPrefix], choice: RoutingChoice, entry: WorkerEntry,
                  ttft: float | None) -> AdmissionDecision:
        """The admission to ``entry``, with the worker it may fetch the prompt's prefix from."""
        info = entry.info
        lenders = {w.info.worker_id for w in self.view.ready_workers("decode", request.model)}
        source = choose_kv_source(held, info.worker_id, lenders, self._fetch)
        if source is not None:
            log.debug("%s: %s holds %d leading blocks: %s may fetch them", request.request_id, source.worker_id,
                      source.num_blocks, info.worker_id)
        return AdmissionDecision(request_id=request.request_id, is_admitted=True,
                                 worker_id=info.worker_id, generate_subject=info.generate_subject,
                                 cancel_subject=info.cancel_subject,
                                 num_overlap_blocks=choice.num_overlap_blocks, predicted_ttft_s=ttft,
                                 kv_source=KvSource(worker_id=source.worker_id, num_blocks=source.num_blocks)
                                 if source is not None else None)

    def _candidates(self, request: GenerateRequest) -> list[WorkerEntry]:
        """The ready decode workers of the request's model, less those it excludes. A request moved
        from a worker that ran its decode rows compiled goes to one that runs compiled too where
        there is one: on a worker still compiling it would run eagerly, in other last bits."""
        workers = [w for w in self.view.ready_workers("decode", request.model)
                   if w.info.worker_id not in request.exclude_workers]
        if request.sampling.decode_path == "compiled":
            return [w for w in workers if w.load is not None and w.load.decode_step == "compiled"] or workers
        return workers

    def _observe(self, request: GenerateRequest, entry: WorkerEntry, workers: list[WorkerEntry],
                 choice: RoutingChoice, now: float) -> AdmissionInput:
        """What the Admitter needs, from the chosen worker's reports and the other workers' queues."""
        tier = self.qos.resolve(request.tier)
        priority = self.qos.tiers[tier].priority
        prompt = max(1, len(request.prompt_token_ids))  # a text worker's request has none: routed on load
        block_size = entry.info.block_size
        load = entry.load
        wait = 0.0
        above = self.inflow.requests_per_s_by_priority_above(entry.info.worker_id, priority, now)
        above_per_s = sum(above.values())
        watched = self.inflow.span_s(entry.info.worker_id, now)
        tokens_above = self.inflow.tokens_per_s_above(entry.info.worker_id, priority, now)
        prefill_rate = (load.prefill_tokens_per_s if load else None) or entry.info.warmup_prefill_tokens_per_s
        if load is not None and load.num_requests_total:
            mean_output = load.output_tokens_recent or self._unfinished_output_tokens(entry.info.worker_id, load, now)
            wait = slot_wait_s(
                num_running=load.num_running_ahead(priority), max_num_seqs=load.max_num_seqs,
                num_waiting_ahead=load.num_waiting_ahead(priority) + entry.num_admitted_ahead(priority, now),
                mean_output_tokens=mean_output, itl_s=self._full_batch_itl_s(load),
                preempting_requests_per_s=above_per_s,
                preempting_output_tokens=sum(
                    r * load.output_tokens_recent_by_priority.get(p, mean_output) for p, r in above.items()
                ) / above_per_s if above_per_s else None, margin_sd=self.admitter.cfg.arrival_margin_sd,
                watched_s=watched, measured_frees_per_s=self.turnover.frees_per_s(entry.info.worker_id, now),
                paused_share=tokens_above / prefill_rate if prefill_rate else 0.0)
        cached = min(choice.num_overlap_blocks * block_size, prompt - 1)
        return AdmissionInput(
            now_s=now, tier=tier, prompt_tokens=prompt, cached_tokens=cached,
            queued_prefill_tokens=entry.prefill_tokens_ahead(priority, block_size, now),
            prefill_tokens_per_s=prefill_rate,
            queued_requests=sum(w.load.num_waiting_by_priority.get(priority, 0) for w in workers if w.load),
            decode_wait_s=wait, itl_s=load.itl_recent_s if load else None,
            num_running=load.num_running if load else 0,
            preempting_tokens_per_s=tokens_above,
            preempting_requests_per_s=above_per_s, inflow_watched_s=watched,
            own_alone_s=load.prefill_alone_s(prompt - cached, cached) if load else None,
            deadline_s=None if request.deadline_at is None else request.deadline_at - now,
            max_output_tokens=request.sampling.max_tokens)

    @staticmethod
    def _full_batch_itl_s(load: WorkerLoad) -> float | None:
        """The ITL while every slot is taken (a slot wait happens only then): the recent ITL, scaled
        by how many more sequences a full batch has than the batch it was measured on (a step costs
        about in proportion to its sequences: an upper bound, as for the ITL budget). A batch that
        filled up within the last seconds has its ITL from the one or two sequences before."""
        itl, measured_on = load.itl_recent_s, load.itl_recent_batch
        if itl is None or not measured_on:
            return itl
        return itl * max(1.0, load.max_num_seqs / measured_on)

    def _unfinished_output_tokens(self, worker_id: str, load: WorkerLoad, now: float) -> float:
        """The answers' length on a worker none of whose requests finished in the last 30 s (one that
        just started serving, or long answers): what it generated over the requests it started
        counts the ones still decoding as if they had ended, so at least the mean max_tokens of the
        requests admitted to it lately, which they may all reach (a batch full of answers started
        a second ago would otherwise look about to free its slots)."""
        so_far = load.num_generated_tokens_total / load.num_requests_total
        recent = self._max_tokens.get(worker_id)
        limit = recent.mean(now) if recent is not None else None
        return so_far if limit is None else max(so_far, limit)

    async def _held_prefixes(self, request: GenerateRequest) -> list[HeldPrefix]:
        """Each worker's hit on the prompt's leading blocks, by tier; none when kv-index is away."""
        if not request.block_hashes:
            return []
        try:
            result = await self._bus.request(self._subjects.kvindex_match(),
                                             KvMatchRequest(block_hashes=request.block_hashes),
                                             timeout_s=self._settings.kv_match_timeout_s)
        except ServiceError as exc:
            self.metrics.kvindex_failures.inc()
            log.warning("kv-index did not answer (%s): routing on load only", exc.message)
            return []
        return [HeldPrefix(o.worker_id, o.num_blocks, o.num_host_blocks, o.num_disk_blocks) for o in result.overlaps]

    def _reject(self, request: GenerateRequest, reason, message: str, retry_after_s: float,
                predicted_ttft_s: float | None = None) -> AdmissionDecision:
        log.info("rejecting %s (tier %s): %s", request.request_id, request.tier, message)
        return AdmissionDecision(request_id=request.request_id, is_admitted=False,
                                 reject_reason=reason, message=message, retry_after_s=retry_after_s,
                                 predicted_ttft_s=predicted_ttft_s)


async def run(settings: AdmissionSettings, stop: asyncio.Event) -> None:
    await run_bus_service("admission", settings, stop,
                          lambda bus, registry: AdmissionService(settings, bus, registry))
