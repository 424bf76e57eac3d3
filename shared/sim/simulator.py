"""Discrete-event simulation of a prefill/decode cluster serving a trace.

A request arrives, is routed to a decode worker (routing policy: KV overlap + load + queue, the
``shared.policy.kv_routing.route``), admitted or
rejected (admission policy: predicted TTFT against its tier's budget), reserves KV on the decode
worker (or waits for memory), and is prefilled locally or remotely (conditional-disaggregation
policy). Remote prefills wait in one global queue that idle prefill workers pull from, local ones
in their decode worker's; both serve by tier priority, then arrival, as the engine scheduler and
the per-priority prefill subjects do (strictly: the live queue's anti-starvation share for lower
tiers is not modelled). Remote prefills' KV then crosses the modelled route to the decode worker.
The first token counts when the KV is on the decode worker; decoding runs on the worker's virtual
step counter (see ``workers.py``). A periodic tick samples utilisation and, if enabled, asks the
autoscaling policy to flip roles.

Events live in one heap of ``(time, seq, kind, a, b)`` tuples; arrivals are read from the trace's
sorted arrays instead of being pushed.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from shared.kvcache.overlap import leading_overlap
from shared.planner.costmodel import kv_transfer_s
from shared.planner.flow import Evaluator
from shared.planner.plan import Plan
from shared.policy.admission import AdmissionConfig, AdmissionInput, Admitter, Inflow, Turnover, slot_wait_s
from shared.cluster.scaling import Autoscaling
from shared.policy.autoscale import AutoscaleConfig, RatioAutoscaler
from shared.policy.autoscale_inputs import Capacities, WorkerSample
from shared.policy.disagg import DisaggConfig, DisaggInput, decide_prefill, may_go_remote
from shared.policy.kv_fetch import FetchConfig
from shared.policy.kv_routing import RoutingInput, RoutingWeights, next_cheapest, route, route_in_turn
from shared.policy.qos import QosConfig, QosTier
from shared.sim.traces import Trace
from shared.sim.workers import DECODE, PREFILL, Worker

PREFILL_FREE, PREFILL_DONE, KV_ARRIVED, DECODE_FINISH, TICK, FETCHED = range(6)
REMOTE = -1   # the prefill pool, as an Inflow key


class PrefillQueue:
    """Prompts waiting for a prefill, served by priority (lower first), then arrival; the tokens
    waiting are summed per priority, for admission's TTFT prediction."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, float]] = []   # (priority, request, uncached tokens)
        self._tokens: dict[int, float] = {}

    def push(self, priority: int, request: int, tokens: float) -> None:
        heapq.heappush(self._heap, (priority, request, tokens))
        self._tokens[priority] = self._tokens.get(priority, 0.0) + tokens

    def pop(self) -> int:
        priority, request, tokens = heapq.heappop(self._heap)
        self._tokens[priority] -= tokens
        return request

    def next_tokens(self) -> float:
        """The tokens of the prompt ``pop`` would return next."""
        return self._heap[0][2]

    def tokens_ahead_of(self, priority: int) -> float:
        """Tokens that would be prefilled before a new prompt of ``priority``."""
        return sum(t for p, t in self._tokens.items() if p <= priority)

    def total_tokens(self) -> float:
        return sum(self._tokens.values())

    def __len__(self) -> int:
        return len(self._heap)


@dataclass(frozen=True)
class SimConfig:
    # The planner sizes the pools for full disaggregation, so by default every prompt goes to the
    # prefill pool unless its queue is long; prefilling short prompts on the decode worker is
    # opt-in (it takes decode time the plan did not budget for).
    disagg: DisaggConfig = DisaggConfig(max_local_prefill_tokens=0)
    routing: RoutingWeights = RoutingWeights()
    admission: AdmissionConfig | None = None      # None: workload_admission(the workload's TTFT SLO)
    autoscale: AutoscaleConfig | None = None      # None: roles stay as planned
    autoscale_window_s: float = 30.0               # demand measured over this long (the service's default)
    # kv_routing weighs load in absolute KV blocks, as the admission service does. With decode
    # workers of different sizes that sends as much work to a small worker as to a big one; with
    # this on, the simulator reports load in blocks scaled to the mean worker size instead.
    capacity_aware_routing: bool = False
    # Sequence slots per decode worker (the engine's max_num_seqs); None: only KV memory bounds
    # the batch. Requests waiting for a slot start by priority, then arrival, as the engine's do.
    max_num_seqs: int | None = None
    # The engine's chunked prefill on a decode worker (its max_num_batched_tokens): a local prefill
    # step takes the queued prompts within this many tokens together, and on a worker that is
    # decoding it rides in the decode step, the step's fixed cost paid once. None: one prompt per
    # step, pausing decode for the whole prefill (the planner's model).
    local_prefill_batch_tokens: int | None = None
    # Route to the decode workers in turn (skipping ineligible ones and those at the queue limit)
    # instead of by ``kv_routing``'s cost: the baseline KV-aware routing is judged against.
    round_robin: bool = False
    # Where the routing's choice would miss a request's SLO, admission tries this many next-cheapest
    # decode workers before rejecting it (the admission service's --fallback-workers); 0: reject.
    fallback_workers: int = 3
    # A decode worker fetches a prompt's cached prefix from the worker holding more of it (the
    # engine's peer fetch: admission names the holder, the worker copies the blocks it lacks over
    # the route between the two before it prefills the rest) where that beats recomputing them.
    # None: off. The transfer is timed on the route (round trip plus bytes over bandwidth) but does
    # not occupy the holder or the links.
    peer_fetch: FetchConfig | None = None
    # Prefix-cache blocks each decode worker keeps (LRU); None: as many as its KV pool holds. More
    # stands for a host-memory tier under the pool (its copy back to the device is not timed).
    prefix_cache_blocks: int | None = None
    # QoS tiers of the requests: (tier, share) pairs, drawn per request with ``seed``.
    tier_mix: tuple[tuple[str, float], ...] = (("standard", 1.0),)
    seed: int = 0
    num_ticks: int = 200                           # utilisation samples over the arrival span


@dataclass
class SimResult:
    arrival_s: np.ndarray
    ttft_s: np.ndarray          # nan where rejected
    tpot_s: np.ndarray          # nan where rejected; 0 for one-token outputs
    finish_s: np.ndarray
    output_len: np.ndarray
    rejected: np.ndarray        # bool
    remote_prefill: np.ndarray  # bool
    cached_tokens: np.ndarray
    tier: np.ndarray = field(default_factory=lambda: np.array([], dtype=object))   # per request
    tick_s: list[float] = field(default_factory=list)
    prefill_util: list[float] = field(default_factory=list)
    decode_kv_util: list[float] = field(default_factory=list)
    num_prefill: list[int] = field(default_factory=list)
    num_decode: list[int] = field(default_factory=list)
    flips: int = 0
    rejections: dict[str, int] = field(default_factory=dict)   # by cause
    admitted_elsewhere: int = 0  # predicted to miss on the routing's choice, admitted on another worker
    num_fetches: int = 0         # prompts whose prefix a decode worker fetched from a peer
    price_per_hour: float = 0.0
    num_events: int = 0


def workload_admission(ttft_slo_s: float) -> AdmissionConfig:
    """The simulator's default tiers around the workload's TTFT SLO: premium is promised twice the
    SLO, batch half of it (shed first), in priority order premium, standard, batch (the order
    the prefill queues serve them in)."""
    ms = ttft_slo_s * 1000.0
    return AdmissionConfig(QosConfig(default_tier="standard", tiers={
        "premium": QosTier(priority=0, ttft_slo_ms=2 * ms),
        "standard": QosTier(priority=1, ttft_slo_ms=ms),
        "batch": QosTier(priority=2, ttft_slo_ms=ms / 2, max_queued=1_000)}), min_retry_after_s=0.0)


# SimResult.rejections counts by these causes
REJECT_CAUSES = {"slo": "predicted TTFT over budget", "shedding": "shed for a higher tier",
                 "tier_queue_full": "tier queue full", "prompt_too_long": "prompt too long",
                 "deadline": "predicted to miss its deadline"}


def build_workers(ev: Evaluator, plan: Plan, cache_block_size: int) -> list[Worker]:
    label_to_index = {d.label(ev.cluster.spec): d.index for d in ev.cluster.devices}
    workers = []
    for w in plan.workers:
        if w.role == "idle":
            continue
        try:
            group = [label_to_index[g] for g in w.gpus]
        except KeyError as exc:
            raise ValueError(f"plan worker {w.worker_id} names GPU {exc.args[0]} not in the cluster") from exc
        e = ev.evaluate(group)
        workers.append(Worker(len(workers), w.worker_id, w.role, group, ev.cluster.hardware(group),
                              e.prefill_par if e.prefill.rate > 0 else None,
                              e.decode_par if e.decode.rate > 0 else None, ev.model, ev.eff, cache_block_size))
    return workers


class Simulator:
    def __init__(self, ev: Evaluator, plan: Plan, cfg: SimConfig = SimConfig(), block_size: int = 512):
        self.ev, self.cfg, self.block_size = ev, cfg, block_size
        self.workers = build_workers(ev, plan, block_size)
        if cfg.prefix_cache_blocks is not None:
            for w in self.workers:
                w.cache_blocks = cfg.prefix_cache_blocks
                w.cache_shares_pool = False
        if not any(w.role == DECODE for w in self.workers):
            raise ValueError("the plan has no decode workers")
        self.admitter = Admitter(cfg.admission or workload_admission(ev.workload.slo.ttft_s))
        self.inflow = Inflow()   # keyed by decode worker index (local prefills), or REMOTE
        # the placeholder capacities are replaced every tick by the plan's, as workers flip
        self.scaling = Autoscaling(RatioAutoscaler(cfg.autoscale), Capacities(1.0, 1.0),
                                   window_s=cfg.autoscale_window_s) if cfg.autoscale else None
        self.heap: list[tuple] = []
        self.seq = 0
        self.now = 0.0
        self.prefill_queue = PrefillQueue()
        self.queued_tokens = 0.0      # remote prefills' uncached tokens, queued or in progress
        self.local_queue = [PrefillQueue() for _ in self.workers]
        self.local_active: list[set[int]] = [set() for _ in self.workers]  # the local prefill step in progress
        self.idle_prefill = [w.index for w in self.workers if w.role == PREFILL]
        self.active_blocks = np.zeros(len(self.workers))
        self.num_waiting = np.zeros(len(self.workers))
        self.started: list[dict[int, int]] = [{} for _ in self.workers]  # holding a slot, by priority
        # requests ended on each worker, and the rate slots free while it has none to spare, as the
        # admission service measures it from the worker's load reports (one report per step that
        # ends a request)
        self.num_ended = [0] * len(self.workers)
        self.turnover = Turnover()
        self.eligible = np.array([w.role == DECODE for w in self.workers])
        caps = np.array([w.kv_capacity for w in self.workers])
        mean_cap = caps[self.eligible].mean() if self.eligible.any() else 1.0
        self.load_scale = (mean_cap / np.maximum(caps, 1.0) if cfg.capacity_aware_routing
                           else np.ones(len(self.workers))) / block_size
        self.index: dict[int, set[int]] = {}      # prefix block hash -> decode workers holding it
        self._rr_last = -1                         # the worker chosen last: round-robin's turn, kv routing's ties
        self._routes: dict[tuple[int, int], float] = {}
        self.num_prompt_tokens = np.zeros(len(self.workers))     # per worker, cumulative, uncached
        self.num_local_only_tokens = np.zeros(len(self.workers))  # of those, prompts too short to go remote
        self.num_generated_tokens = np.zeros(len(self.workers))  # (counted when admitted)
        self._busy_start: list[float] = []    # prefill busy intervals, for utilisation per tick
        self._busy_end: list[float] = []
        # Planned per-worker capacity in tokens/s (within SLO), for autoscaling; and the prefill
        # drain rate when busy (no SLO headroom), for admission's TTFT prediction.
        self.cap_tps = {w.index: (ev.evaluate(w.group).prefill.rate * ev.input_len,
                                  ev.evaluate(w.group).decode.rate * ev.output_len) for w in self.workers}
        self.drain_tps = {w.index: ev.input_len / w.prefill_times(int(ev.input_len))[1]
                          for w in self.workers if w.prefill_par}

    def _pool_capacity_tps(self, role: str) -> float:
        k = 0 if role == PREFILL else 1
        return sum(self.cap_tps[w.index][k] for w in self.workers if w.role == role and not w.draining)

    def _per_worker_capacity_tps(self, role: str, num_role: int) -> float:
        """One worker's capacity in ``role``: the mean over those in it, or with none, over every worker
        able to run it (as a worker would after a flip)."""
        if num_role:
            return self._pool_capacity_tps(role) / num_role
        k = 0 if role == PREFILL else 1
        able = [self.cap_tps[w.index][k] for w in self.workers if self.cap_tps[w.index][k] > 0]
        return sum(able) / len(able) if able else 0.0

    def _prefill_drain_tps(self) -> float:
        return sum(self.drain_tps[w.index] for w in self.workers if w.role == PREFILL and not w.draining)

    # --- event plumbing --------------------------------------------------------------------
    def push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def run(self, trace: Trace) -> SimResult:
        n = len(trace)
        self.arrival = trace.arrival_s.tolist()
        self.inp, self.out = trace.input_len.tolist(), trace.output_len.tolist()
        self.hashes = trace.hash_ids
        self.ttft, self.tpot = [math.nan] * n, [math.nan] * n
        self.finish, self.join_t = [math.nan] * n, [0.0] * n
        self.rejected, self.remote = [False] * n, [False] * n
        self.cached, self.uncached, self.dest = [0] * n, [0] * n, [0] * n
        self.fetch_s = [0.0] * n
        if trace.tiers is not None:
            self.tier = list(trace.tiers)
        else:
            names = [t for t, _ in self.cfg.tier_mix]
            shares = np.array([f for _, f in self.cfg.tier_mix], dtype=float)
            tiers = np.random.default_rng(self.cfg.seed).choice(len(names), size=n, p=shares / shares.sum())
            self.tier = [names[k] for k in tiers]
        qos = self.admitter.cfg.qos.tiers
        self.priority = [qos[t].priority if t in qos else 0 for t in self.tier]
        self.res = SimResult(trace.arrival_s, np.array([]), np.array([]), np.array([]), trace.output_len,
                             np.array([]), np.array([]), np.array([]),
                             price_per_hour=self.ev.cluster.spec.price_per_hour())
        span = (self.arrival[-1] - self.arrival[0]) if n > 1 else 1.0
        self.tick_every = max(span / self.cfg.num_ticks, 1e-3)
        self.pending = n
        self.push(self.arrival[0] if n else 0.0, TICK, 0)
        handlers = (self._prefill_free, self._prefill_done, self._kv_arrived, self._decode_finish, self._tick,
                    self._queue_prefill)
        heap, arrival, i, events = self.heap, self.arrival, 0, 0
        while i < n or heap:
            if heap and (i >= n or heap[0][0] <= arrival[i]):
                t, _, kind, a, b = heapq.heappop(heap)
                self.now = t
                handlers[kind](a, b)
            else:
                self.now = arrival[i]
                self._arrive(i)
                i += 1
            events += 1
        r = self.res
        r.ttft_s, r.tpot_s, r.finish_s = np.array(self.ttft), np.array(self.tpot), np.array(self.finish)
        r.rejected, r.remote_prefill = np.array(self.rejected), np.array(self.remote)
        r.cached_tokens, r.num_events = np.array(self.cached), events
        r.tier = np.array(self.tier, dtype=object)
        r.prefill_util = self._prefill_util(r.tick_s, r.num_prefill)
        return r

    def _prefill_util(self, ticks: list[float], num_prefill: list[int]) -> list[float]:
        """Busy fraction of the prefill pool in each tick interval [t_k, t_k + dt), from the busy
        intervals: integrate the number of busy workers (a step function) over each interval."""
        if not self._busy_start:
            return [0.0] * len(ticks)
        times = np.concatenate([self._busy_start, self._busy_end])
        steps = np.concatenate([np.ones(len(self._busy_start)), -np.ones(len(self._busy_end))])
        order = np.argsort(times, kind="stable")
        times, level = times[order], np.cumsum(steps[order])   # level: busy workers after each event
        busy_integral = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(times))])
        edges = np.array(ticks + [ticks[-1] + self.tick_every])
        busy = np.diff(np.interp(edges, times, busy_integral))
        return [float(min(b / (self.tick_every * n), 1.0)) if n else 0.0 for b, n in zip(busy, num_prefill)]

    # --- arrival: route, admit, reserve ----------------------------------------------------
    def _arrive(self, i: int) -> None:
        inp, hashes = self.inp[i], (self.hashes[i] if self.hashes is not None else [])
        overlap = leading_overlap(self.index.get(h, ()) for h in hashes)
        routing = RoutingInput(self.now, -(-inp // self.block_size), overlap, self.active_blocks,
                               self.num_waiting, self.eligible)
        if self.cfg.round_robin:
            choice = route_in_turn(routing, self._rr_last + 1, self.cfg.routing)
        else:
            choice = route(routing, self.cfg.routing, tie_start=self._rr_last + 1)
        self._rr_last = self._rr_last if choice.worker is None else choice.worker
        if choice.worker is None:
            return self._reject(i, "no decode worker under its queue limit")
        seen: list[tuple[AdmissionInput, Worker, int, bool, float]] = []

        def ranked():   # the routing's choice, then (only where it would miss) the next cheapest
            yield choice
            yield from next_cheapest(routing, choice.worker, self.cfg.routing, self.cfg.fallback_workers)

        def candidates():
            for d in ranked():
                seen.append(self._admission_input(i, self.workers[d.worker], d.overlap_blocks, overlap))
                yield seen[-1][0]

        k, decision = self.admitter.decide_first(candidates())
        if not decision.admitted:
            return self._reject(i, REJECT_CAUSES[decision.code])
        self.res.admitted_elsewhere += k > 0
        _, w, cached, remote, fetch_s = seen[k]
        priority = self.priority[i]
        self.inflow.note(REMOTE if remote else w.index, self.now, priority, inp - cached)
        self.cached[i], self.uncached[i], self.dest[i], self.remote[i] = cached, inp - cached, w.index, remote
        self.fetch_s[i] = fetch_s
        self.res.num_fetches += fetch_s > 0
        self.num_prompt_tokens[w.index] += inp - cached
        if not may_go_remote(inp, self.cfg.disagg):
            self.num_local_only_tokens[w.index] += inp - cached
        self.num_generated_tokens[w.index] += self.out[i]
        if w.kv_used + inp + self.out[i] > w.kv_capacity and w.kv_used > 0 or not self._has_free_slot(w):
            w.waiting.append(i)
            self.num_waiting[w.index] = len(w.waiting)
        else:
            self._start(i, w)

    def _admission_input(self, i: int, w: Worker, overlap_blocks: int, overlap: dict[int, int]
                         ) -> tuple[AdmissionInput, Worker, int, bool, float]:
        """What admission sees for request ``i`` on decode worker ``w`` holding ``overlap_blocks`` of
        its prompt (``overlap``: every worker's), with the prompt's tokens cached there once any peer
        fetch is done, whether it prefills remotely, and how long the fetch takes (0: none). Admission
        predicts on ``w``'s own hit, as the service does (it does not count a fetch in)."""
        inp = self.inp[i]
        cached, fetch_s = self._after_fetch(i, w, overlap_blocks, overlap)
        remote = decide_prefill(DisaggInput(self.now, inp, cached, len(self.prefill_queue),
                                            bool(self.idle_prefill) or self._num_role(PREFILL) > 0),
                                self.cfg.disagg).remote
        priority = self.priority[i]
        if remote:
            in_progress = self.queued_tokens - self.prefill_queue.total_tokens()
            if self.idle_prefill:   # an idle worker takes it as soon as the prompts ahead of it start
                in_progress = 0.0
            queued, rate = in_progress + self.prefill_queue.tokens_ahead_of(priority), self._prefill_drain_tps()
            own_s = min((p.prefill_times(inp - cached)[0] for p in self.workers
                         if p.role == PREFILL and not p.draining), default=None)
        else:
            own_s = w.prefill_times(inp - cached)[0]
            rate = (inp - cached) / max(own_s, 1e-9)
            in_progress = max(w.stall_until - self.now, 0.0) * rate if self.local_active[w.index] else 0.0
            queued = in_progress + self.local_queue[w.index].tokens_ahead_of(priority)
        backlog = max(w.ingress_free - self.now, 0.0) if remote else 0.0   # KV transfers queued at w
        prefill = REMOTE if remote else w.index
        above_per_s = self.inflow.requests_per_s_above(prefill, priority, self.now)
        watched = self.inflow.span_s(prefill, self.now)
        tokens_above = self.inflow.tokens_per_s_above(prefill, priority, self.now)
        paused = 0.0 if remote else tokens_above / rate  # w's own prefills stall its rows
        adm = AdmissionInput(
            self.now, self.tier[i], inp, min(overlap_blocks * self.block_size, inp - 1), queued, rate,
            len(self.prefill_queue) if remote else len(w.waiting), transfer_s=backlog,
            decode_wait_s=max(self._memory_wait_s(w, inp + self.out[i]),
                              self._slot_wait_s(w, priority, above_per_s, watched, paused)),
            preempting_tokens_per_s=tokens_above, own_prefill_s=own_s,
            preempting_requests_per_s=above_per_s, inflow_watched_s=watched)
        return adm, w, cached, remote, fetch_s

    def _after_fetch(self, i: int, w: Worker, own_blocks: int, overlap: dict[int, int]) -> tuple[int, float]:
        """(tokens of request ``i``'s prompt cached on ``w``, seconds its peer fetch takes): the
        holder of the longest run of its leading blocks lends what ``w`` lacks when that is at least
        ``min_blocks`` and copying them is faster than prefilling them on ``w``."""
        inp, bs, fetch = self.inp[i], self.block_size, self.cfg.peer_fetch
        own = min(own_blocks * bs, inp - 1)
        if fetch is None:
            return own, 0.0
        holder = max((j for j in overlap if j != w.index and self.workers[j].role == DECODE),
                     key=lambda j: (overlap[j], -j), default=None)
        if holder is None or round(overlap[holder]) - own_blocks < fetch.min_blocks:
            return own, 0.0
        lent = min(round(overlap[holder]) * bs, inp - 1) - own
        gbps = self.ev.cluster.route_gbps(self.workers[holder].group, w.group)
        transfer_s = fetch.round_trip_s + kv_transfer_s(self.ev.model, lent, gbps, self.ev.eff)
        if transfer_s >= w.prefill_times(lent)[0]:
            return own, 0.0
        return own + lent, transfer_s

    def _memory_wait_s(self, w: Worker, tokens: int) -> float:
        """Until enough sequences finish to make room: each step of the batch frees about
        batch / mean-output sequences."""
        if w.kv_used + tokens <= w.kv_capacity or not w.finish_heap:
            return 0.0
        batch = len(w.finish_heap)
        return (len(w.waiting) + 1) * self.ev.output_len * w.step_time / batch

    def _has_free_slot(self, w: Worker) -> bool:
        return self.cfg.max_num_seqs is None or sum(self.started[w.index].values()) < self.cfg.max_num_seqs

    def _slot_wait_s(self, w: Worker, priority: int, above_per_s: float, watched_s: float | None,
                     paused_share: float) -> float:
        """The admission service's slot wait (``slot_wait_s``) on what this worker would report, with
        the requests per second arriving above ``priority`` at its prefill, counted over ``watched_s``,
        and the share of its time that prefills them (``paused_share``)."""
        if self.cfg.max_num_seqs is None:
            return 0.0
        return slot_wait_s(num_running=sum(n for p, n in self.started[w.index].items() if p <= priority),
                           max_num_seqs=self.cfg.max_num_seqs,
                           num_waiting_ahead=sum(1 for j in w.waiting if self.priority[j] <= priority),
                           mean_output_tokens=self.ev.output_len, itl_s=w.step_time or None,
                           preempting_requests_per_s=above_per_s, margin_sd=self.admitter.cfg.arrival_margin_sd,
                           watched_s=watched_s,
                           measured_frees_per_s=self.turnover.frees_per_s(w.index, self.now),
                           paused_share=paused_share)

    def _reject(self, i: int, cause: str) -> None:
        self.res.rejections[cause] = self.res.rejections.get(cause, 0) + 1
        self.rejected[i] = True
        self.pending -= 1

    def _start(self, i: int, w: Worker) -> None:
        w.kv_used += self.inp[i] + self.out[i]
        slots = self.started[w.index]
        slots[self.priority[i]] = slots.get(self.priority[i], 0) + 1
        self.active_blocks[w.index] = w.kv_used * self.load_scale[w.index]
        if self.fetch_s[i]:   # its prefix first comes over from the holder
            self.push(self.now + self.fetch_s[i], FETCHED, i, w.index)
        else:
            self._queue_prefill(i, w.index)

    def _queue_prefill(self, i: int, w_index: int) -> None:
        w = self.workers[w_index]
        if self.remote[i]:
            self.prefill_queue.push(self.priority[i], i, self.uncached[i])
            self.queued_tokens += self.uncached[i]
            self._dispatch()
        else:
            self.local_queue[w.index].push(self.priority[i], i, self.uncached[i])
            self._start_local(w)

    def _start_local(self, w: Worker) -> None:
        """The decode worker's next local prefill step, if none is in progress: it pauses decoding.
        The step takes the next prompt, and the ones after it within ``local_prefill_batch_tokens``."""
        queue, active = self.local_queue[w.index], self.local_active[w.index]
        if active or not queue:
            return
        budget = self.cfg.local_prefill_batch_tokens
        tokens = 0.0
        while queue and (not active or budget is not None and tokens + queue.next_tokens() <= budget):
            i = queue.pop()
            active.add(i)
            tokens += self.uncached[i]
        seconds = w.prefill_times(int(tokens))[0]
        if budget is not None and w.finish_heap:
            seconds -= self.ev.eff.prefill_overhead_s
        end = w.stall(self.now, seconds)
        self._reschedule(w)
        for i in sorted(active):
            self.push(end, KV_ARRIVED, i, w.index)

    def _num_role(self, role: str) -> int:
        return sum(1 for w in self.workers if w.role == role and not w.draining)

    # --- prefill pool ----------------------------------------------------------------------
    def _dispatch(self) -> None:
        while self.prefill_queue and self.idle_prefill:
            p = self.workers[self.idle_prefill.pop()]
            i = self.prefill_queue.pop()
            latency, service = p.prefill_times(self.uncached[i])
            p.busy_s += service
            self._busy_start.append(self.now)
            self._busy_end.append(self.now + service)
            self.push(self.now + service, PREFILL_FREE, p.index)
            self.push(self.now + latency, PREFILL_DONE, i, p.index)

    def _prefill_free(self, p_index: int, _: int) -> None:
        p = self.workers[p_index]
        if p.draining:
            self._flip(p, DECODE)
        else:
            self.idle_prefill.append(p_index)
            self._dispatch()

    def _prefill_done(self, i: int, p_index: int) -> None:
        """Ship the KV. Between nodes a transfer occupies the prefill group's NICs and the decode
        group's NICs (each at its aggregate bandwidth; transfers queue on both), and arrives after
        the route's transfer time; within a node it uses the node's links without queueing."""
        self.queued_tokens -= self.uncached[i]
        p, d = self.workers[p_index], self.workers[self.dest[i]]
        key = (p_index, d.index)
        if key not in self._routes:
            near = {self.ev.cluster.devices[x].node for x in p.group + d.group}
            self._routes[key] = (self.ev.cluster.route_gbps(p.group, d.group), len(near) == 1)
        gbps, same_node = self._routes[key]
        xfer = kv_transfer_s(self.ev.model, self.uncached[i], gbps, self.ev.eff)
        start = self.now
        if not same_node:
            nic = self.ev.cluster.spec.inter_node_gbps
            start = max(self.now, p.egress_free, d.ingress_free)
            p.egress_free = start + kv_transfer_s(self.ev.model, self.uncached[i], nic * len(p.group), self.ev.eff)
            d.ingress_free = start + kv_transfer_s(self.ev.model, self.uncached[i], nic * len(d.group), self.ev.eff)
        self.push(start + xfer, KV_ARRIVED, i, d.index)

    # --- decode pool -----------------------------------------------------------------------
    def _kv_arrived(self, i: int, d_index: int) -> None:
        d = self.workers[d_index]
        active = self.local_active[d_index]
        if i in active:
            active.discard(i)
            if not active:
                self._start_local(d)
        self.ttft[i] = self.now - self.arrival[i]
        self.join_t[i] = self.now
        if self.hashes is not None:
            # only whole blocks are cached, as the engine's prefix cache does (a partial last block's
            # id may name a longer block in a later prompt)
            d.running_cached_blocks += self.inp[i] // self.block_size
            d.cache_insert(self.hashes[i][:self.inp[i] // self.block_size], self.index)
        if self.out[i] <= 1:
            self._complete(i, d)
            self._admit_waiting(d)
            self._report(d)
        else:
            d.join(self.now, i, self.out[i] - 1, self.inp[i] + self.out[i] / 2)
        self._reschedule(d)

    def _reschedule(self, d: Worker) -> None:
        t = d.next_finish(self.now)
        if t is not None:
            self.push(t, DECODE_FINISH, d.index, d.version)

    def _decode_finish(self, d_index: int, version: int) -> None:
        d = self.workers[d_index]
        if version != d.version:
            return
        for i in d.pop_finished(self.now):
            d.sum_ctx -= self.inp[i] + self.out[i] / 2
            self._complete(i, d)
        self._admit_waiting(d)
        self._report(d)
        self._reschedule(d)
        if d.draining and not d.finish_heap and d.kv_used == 0:
            self._flip(d, PREFILL)

    def _complete(self, i: int, d: Worker) -> None:
        self.finish[i] = self.now
        self.tpot[i] = (self.now - self.join_t[i]) / (self.out[i] - 1) if self.out[i] > 1 else 0.0
        d.kv_used -= self.inp[i] + self.out[i]
        if self.hashes is not None:  # its whole prompt blocks joined the cache in _kv_arrived
            d.running_cached_blocks -= self.inp[i] // self.block_size
        self.started[d.index][self.priority[i]] -= 1
        self.num_ended[d.index] += 1
        self.active_blocks[d.index] = d.kv_used * self.load_scale[d.index]
        self.pending -= 1

    def _report(self, d: Worker) -> None:
        """What the load report after a request ends tells admission's ``Turnover``."""
        if self.cfg.max_num_seqs is not None:
            busy = sum(self.started[d.index].values()) + len(d.waiting)
            self.turnover.note(d.index, self.now, self.num_ended[d.index], busy >= self.cfg.max_num_seqs)

    def _admit_waiting(self, d: Worker) -> None:
        """Start waiting requests while memory and slots allow: by priority, then arrival."""
        while d.waiting and self._has_free_slot(d):
            i = min(d.waiting, key=lambda j: (self.priority[j], j))
            if d.kv_used > 0 and d.kv_used + self.inp[i] + self.out[i] > d.kv_capacity:
                break
            d.waiting.remove(i)
            self._start(i, d)
        self.num_waiting[d.index] = len(d.waiting)

    # --- ticks: utilisation samples and autoscaling ----------------------------------------
    def _tick(self, _a: int, _b: int) -> None:
        r, dt = self.res, self.tick_every
        num_p, num_d = self._num_role(PREFILL), self._num_role(DECODE)
        dec = [w for w in self.workers if w.role == DECODE]
        r.tick_s.append(self.now)
        r.decode_kv_util.append(sum(w.kv_used for w in dec) / max(sum(w.kv_capacity for w in dec), 1.0))
        r.num_prefill.append(num_p)
        r.num_decode.append(num_d)
        if self.scaling:
            self._autoscale(num_p, num_d)
        if self.pending > 0:
            self.push(self.now + dt, TICK, 0)

    def _autoscale(self, num_p: int, num_d: int) -> None:
        """The autoscaler service's own tick (``shared.cluster.scaling``: demand over its window
        from per-worker counters, no decision while a worker drains, the cooldown counted from when
        a flip is done, the least busy workers flipped), on this simulation's workers."""
        self.scaling.defaults = Capacities(self._per_worker_capacity_tps(PREFILL, num_p),
                                           self._per_worker_capacity_tps(DECODE, num_d))
        plan = self.scaling.plan_samples(self.now, [self._sample(w) for w in self.workers])
        by_name = {w.name: w for w in self.workers}
        for flip in plan.flips:
            w = by_name[flip.worker_id]
            if w.prefill_par if flip.to_role == PREFILL else w.decode_par:  # it can run the other phase
                self._start_flip(w)
        self.scaling.record(plan, [])

    def _sample(self, w: Worker) -> WorkerSample:
        """What the worker's load report would say: its cumulative counters, as the engine's."""
        return WorkerSample(w.name, w.role, is_ready=not w.draining, timestamp=self.now,
                            num_prompt_tokens=int(self.num_prompt_tokens[w.index]), num_cached_prompt_tokens=0,
                            num_generated_tokens=int(self.num_generated_tokens[w.index]),
                            num_local_only_prompt_tokens=int(self.num_local_only_tokens[w.index]),
                            num_in_flight=len(w.finish_heap) + len(w.waiting), num_waiting=len(w.waiting))

    def _start_flip(self, w: Worker) -> None:
        w.draining = True
        self.res.flips += 1
        if w.role == DECODE:
            self.eligible[w.index] = False
            if not w.finish_heap and w.kv_used == 0:
                self._flip(w, PREFILL)
        elif w.index in self.idle_prefill:
            self.idle_prefill.remove(w.index)
            self._flip(w, DECODE)

    def _flip(self, w: Worker, role: str) -> None:
        w.role, w.draining = role, False
        if role == PREFILL:
            self.eligible[w.index] = False
            w.cache.clear()
            for owners in self.index.values():
                owners.discard(w.index)
            self.idle_prefill.append(w.index)
            self._dispatch()
        else:
            self.eligible[w.index] = True
