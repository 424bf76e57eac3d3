"""Admission: admit or reject a request before any work is done (early rejection, after Mooncake).

Each tier (``shared.policy.qos``) has a priority and a TTFT SLO. A request is rejected when

1. its prompt is longer than any worker takes, or its own prefill alone takes longer than its tier's
   TTFT SLO on the worker that would run it (``own_prefill_s``, or its uncached tokens at that
   worker's measured prefill rate: ``prompt_too_long``; no load shedding can fix it, so it sheds no
   other tier);
2. its tier already has ``max_queued`` requests waiting (``tier_queue_full``);
3. a tier of higher priority was rejected for its SLO within ``shed_hold_s`` (``shedding``): a
   higher tier is never rejected while a lower one is admitted to the same capacity, so the
   lowest priority is shed first and the rest stays shed while the higher tier is short;
4. one more request on the chosen worker would push its inter-token latency over the ITL budget
   (``itl_slo_ms``) of a higher tier (``shedding`` too): the headroom kept for the higher tiers.
   The ITL prediction scales the worker's measured ITL by its batch growing by one (a decode step
   costs about in proportion to the sequences in it: an upper bound, the fixed part ignored);
5. its predicted TTFT exceeds its tier's SLO (``slo``).

Predicted TTFT = (prefill tokens queued ahead of it + its own uncached tokens, or as many as the
worker's length-aware fit says its prompt takes alone where that is more: ``own_alone_s``, since
attention makes a long prompt's tokens slower than the average) / (the measured
prefill rate − the rate at which higher-priority prompt tokens arrive) + the KV transfer + any wait
for KV memory or a sequence slot (``slot_wait_s``: the requests ahead beyond the free slots, at
the rate slots free: from output lengths and ITL, stretched by the steps that prefill
higher-priority prompts without this priority's rows, or as measured while the worker had none to
spare, ``Turnover``). Only
work of the same or a higher priority is ahead: the engine and the prefill queue serve by
priority, so higher-priority work that arrives while the request waits goes first too (``Inflow``
measures it; a fluid estimate: the request is served when the prefill has done the backlog, its
own tokens and what arrived above it meanwhile). Where the caller knows how long the prompt's own
prefill takes on the one worker that will run it (``own_prefill_s``: a pool's rate is the sum of
its workers', but one prompt is not split across them), that time replaces its own tokens' share
of the fluid estimate. The arrivals above it are a Poisson count over the wait, so the wait counts
``arrival_margin_sd`` standard deviations of that count more than their mean (``fluid_wait_s``):
the prediction is an upper bound a request meets about 95% of the time at the default 1.645, not
the mean, which a short surge of higher-priority arrivals after its admission overruns (admitted
batch requests predicted 5-8 s took 11-14 s while premium ran 1.4x its mean rate for 13 s). The
count's spread includes that of the rate itself, measured over the time watched: in the first
second of a burst two premium arrivals say little about the next ten seconds. A
full batch delays it only by the running
requests of its own or a higher priority (the engine preempts a lower one for it). With no
measured rate yet (a worker that has not prefilled) there is no prediction and the request is
admitted. A rejection carries ``retry_after_s``: when the backlog ahead would have drained to the SLO.

Rules 4 and 5, and the deadline, depend on the worker: ``Admitter.decide_first`` tries the next
cheapest workers (``shared.policy.kv_routing.next_cheapest``) before it rejects, so a follow-up turn
whose prefix sits on a busy worker is served from scratch by an idle one rather than turned away,
and a higher tier's miss sheds the lower tiers only when every worker it could go to misses.

``Admitter.decide`` is pure apart from the shedding memory; the caller passes ``now_s``. The admission
service and the simulator call it with their own observations.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from shared.policy.qos import QosConfig

RejectCode = Literal["prompt_too_long", "tier_queue_full", "shedding", "slo", "deadline"]


@dataclass(frozen=True)
class AdmissionInput:
    now_s: float
    tier: str
    prompt_tokens: int
    cached_tokens: int
    queued_prefill_tokens: float       # uncached tokens of this priority or higher, waiting or in progress
    prefill_tokens_per_s: float | None  # rate of the prefill that will serve it; None: not measured yet
    queued_requests: int = 0           # requests of this tier already waiting
    transfer_s: float = 0.0            # expected KV transfer time
    decode_wait_s: float = 0.0         # expected wait for KV memory or a sequence slot on the chosen worker
    itl_s: float | None = None         # the chosen worker's recent inter-token latency; None: not measured
    num_running: int = 0               # requests running on the chosen worker
    preempting_tokens_per_s: float = 0.0  # uncached prompt tokens per second arriving at higher
                                          # priorities for the same prefill (``Inflow``)
    deadline_s: float | None = None    # the request must finish within this many seconds; None: no deadline
    max_output_tokens: int = 1         # its max_tokens: the longest it can run
    own_prefill_s: float | None = None  # its own uncached tokens' prefill on the one worker that runs
                                        # it; None: own tokens at ``prefill_tokens_per_s``
    preempting_requests_per_s: float = 0.0  # the requests those tokens arrive in (``Inflow``): the
                                            # count whose spread the margin covers
    inflow_watched_s: float | None = None   # the time those rates are measured over (``Inflow.span_s``);
                                            # None: rates known exactly
    own_alone_s: float | None = None   # its own uncached tokens' prefill alone on the chosen worker by
                                       # the worker's length-aware fit (``WorkerLoad.prefill_alone_s``):
                                       # where longer than at the rate, its own tokens count as this much


@dataclass(frozen=True)
class AdmissionDecision:
    admitted: bool
    reason: str
    predicted_ttft_s: float | None
    retry_after_s: float = 0.0
    code: RejectCode | None = None     # None when admitted
    worker_bound: bool = False         # rejected for what the chosen worker would do (its TTFT, its
                                       # ITL, the deadline on it): another worker may admit it


@dataclass(frozen=True)
class AdmissionConfig:
    qos: QosConfig = field(default_factory=QosConfig.single)
    max_prompt_tokens: int = 131_072
    min_retry_after_s: float = 1.0
    shed_hold_s: float = 2.0           # lower tiers stay shed this long after a higher tier's SLO miss
    arrival_margin_sd: float = 1.645   # standard deviations of the higher tiers' arrivals counted
                                       # beyond their mean (``fluid_wait_s``); 0: the mean alone


def fluid_wait_s(work: float, rate_left: float, arrivals_per_s: float = 0.0, work_per_arrival: float = 0.0,
                 margin_sd: float = 0.0, watched_s: float | None = None) -> float:
    """How long ``work`` takes at ``rate_left`` (the rate less the mean work arriving above it),
    when the arrivals above it during the wait W are counted ``margin_sd`` standard deviations over
    their mean, each bringing ``work_per_arrival``: W · rate_left = work + margin_sd ·
    work_per_arrival · sd(W). The count is Poisson with the rate λ measured over the last
    ``watched_s``; its variance over W is λW, plus λW²/watched_s for the rate itself being a
    count over ``watched_s`` (None: a rate known exactly). So a rate from the first second's two
    arrivals leaves a wide margin, one from a full window a narrow one.

    With a known rate it is a quadratic in √W; otherwise the left side less the right is convex in
    W, negative at 0, and has one root when rate_left > margin_sd · work_per_arrival · √(λ /
    watched_s) (found by bisection), none (infinite wait) when the rate's own uncertainty grows
    faster than the rate left."""
    if rate_left <= 0:
        return math.inf
    work = max(work, 0.0)
    c = margin_sd * work_per_arrival
    lam = max(arrivals_per_s, 0.0)
    if c <= 0 or lam <= 0:
        return work / rate_left
    if watched_s is None:
        b = c * math.sqrt(lam)
        root = (b + math.sqrt(b * b + 4 * rate_left * work)) / (2 * rate_left)
        return root * root
    slope = c * math.sqrt(lam / watched_s)
    if rate_left <= slope:
        return math.inf

    def excess(w: float) -> float:
        return rate_left * w - work - c * math.sqrt(lam * w + lam * w * w / watched_s)

    hi = max(work / rate_left, 1e-3)
    while excess(hi) < 0:
        hi *= 2
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
    return hi


def predict_ttft_s(inp: AdmissionInput, margin_sd: float = 0.0) -> float | None:
    """The fluid estimate in the module docstring, with ``margin_sd`` standard deviations of the
    higher tiers' arrivals over the prefill wait (``fluid_wait_s``; ``decode_wait_s`` brings its own)."""
    if inp.prefill_tokens_per_s is None:
        return None
    if inp.prefill_tokens_per_s <= 0:
        return math.inf
    own = max(inp.prompt_tokens - inp.cached_tokens, 0)
    if inp.own_alone_s is not None:   # a long prompt's tokens are more work than the rate says
        own = max(own, inp.own_alone_s * inp.prefill_tokens_per_s)
    rate_left = inp.prefill_tokens_per_s - inp.preempting_tokens_per_s
    if rate_left <= 0:
        return math.inf  # higher priorities alone take the whole prefill
    per_arrival = inp.preempting_tokens_per_s / inp.preempting_requests_per_s if inp.preempting_requests_per_s else 0.0
    work = inp.queued_prefill_tokens + (own if inp.own_prefill_s is None else 0)
    wait = fluid_wait_s(work, rate_left, inp.preempting_requests_per_s, per_arrival, margin_sd, inp.inflow_watched_s)
    own_s = 0.0 if inp.own_prefill_s is None else inp.own_prefill_s
    return wait + own_s + inp.transfer_s + inp.decode_wait_s


def own_prefill_alone_s(inp: AdmissionInput) -> float | None:
    """How long the prompt's own uncached tokens take to prefill with nothing ahead of them and
    nothing arriving above them: ``own_prefill_s`` where given, else those tokens at the worker's
    measured rate (a worker's rate is a one-worker rate), or ``own_alone_s`` where that is longer;
    None when no rate is measured."""
    if inp.own_prefill_s is not None:
        return inp.own_prefill_s
    if not inp.prefill_tokens_per_s:
        return None
    at_rate = max(inp.prompt_tokens - inp.cached_tokens, 0) / inp.prefill_tokens_per_s
    return at_rate if inp.own_alone_s is None else max(at_rate, inp.own_alone_s)


def predict_finish_s(inp: AdmissionInput, ttft_s: float | None) -> float | None:
    """When the request would finish at the latest: its first token, then every other token it may
    generate (``max_output_tokens``) at the chosen worker's ITL with it in the batch. None while the
    prefill rate or the ITL is not measured yet."""
    itl = predict_itl_s(inp)
    if ttft_s is None or itl is None:
        return None
    return ttft_s + max(inp.max_output_tokens - 1, 0) * itl


def predict_itl_s(inp: AdmissionInput) -> float | None:
    """The chosen worker's ITL with this request in its batch too."""
    if inp.itl_s is None:
        return None
    return inp.itl_s * (inp.num_running + 1) / max(inp.num_running, 1)


def slot_wait_s(*, num_running: int, max_num_seqs: int, num_waiting_ahead: int, mean_output_tokens: float,
                itl_s: float | None, preempting_requests_per_s: float = 0.0,
                preempting_output_tokens: float | None = None, margin_sd: float = 0.0,
                watched_s: float | None = None, measured_frees_per_s: float | None = None,
                paused_share: float = 0.0) -> float:
    """Expected wait for a sequence slot on a worker whose batch holds ``num_running`` requests it
    cannot preempt (those of its own or a higher priority). The requests ahead of this one, then
    itself, take the free slots first; the rest each take a slot as a running request finishes.
    (A worker reports its load as a request finishes, when a slot is free for the queue to take at
    the next step: a full batch with a queue shows a free slot in most reports.)

    The requests of higher priorities arriving meanwhile (``preempting_requests_per_s``) take freed
    slots first and hold each for their own output length (``preempting_output_tokens``; None: the
    mean), so by Little's law they keep rate × output × ITL slots busy. The other slots turn over
    once per mean output length × ITL: the rate at which slots free for this request. (Counting
    each higher-priority arrival as a whole slot lost made a few short premium answers look like
    they took every slot behind one long batch answer on a one-sequence worker.) Their count over
    the wait is taken ``margin_sd`` standard deviations over its mean (``fluid_wait_s``, the rate
    measured over ``watched_s``): each arrival costs the slot turnovers of its own output over the
    mean one.

    ``measured_frees_per_s`` (``Turnover``): the rate slots freed on this worker while it had no
    slot to spare, measured. Where given it replaces the turnover that output lengths and ITL
    imply: the engine's prefill steps, which leave lower priorities' rows out, and every other
    cost of the shared CPU are in it. The higher-priority arrivals take one freed slot each (their
    own finishes are among the measured ones).

    Until then, ``paused_share``: the share of the worker's time its steps spend prefilling
    higher-priority prompts (their tokens arriving per second over its prefill rate; more than 1
    counts as 1). Such a step leaves this priority's rows out (``Scheduler._pause_lower_priorities``),
    so they decode only in the rest of the time and hold their slots that much longer than output
    length × ITL. (Batch
    answers behind premium arriving at 0.9x of the capacity ran at 5x the premium rows' ITL, and
    batch requests admitted in a run's first second at predicted slot waits of 5 s first ran after
    13-40 s.)"""
    num_free = max(max_num_seqs - num_running, 0)
    num_to_free = num_waiting_ahead + 1 - num_free
    if num_to_free <= 0:
        return 0.0
    if measured_frees_per_s is not None:
        return fluid_wait_s(num_to_free, measured_frees_per_s - preempting_requests_per_s, preempting_requests_per_s,
                            1.0, margin_sd, watched_s)
    if not itl_s or mean_output_tokens <= 0:
        return 0.0
    above_output = mean_output_tokens if preempting_output_tokens is None else preempting_output_tokens
    held_above = preempting_requests_per_s * above_output * itl_s
    rate_left = (max_num_seqs - held_above) * (1.0 - min(paused_share, 1.0)) / (mean_output_tokens * itl_s)
    if rate_left <= 0:
        return math.inf  # higher priorities alone keep every slot busy
    return fluid_wait_s(num_to_free, rate_left, preempting_requests_per_s, above_output / mean_output_tokens,
                        margin_sd, watched_s)


class Inflow:
    """Requests and their uncached prompt tokens admitted per second to each prefill (``key``: a
    worker, or a pool), by priority, over the last ``window_s``: the work of higher priorities that
    arrives while a request waits and goes first (``AdmissionInput.preempting_tokens_per_s``,
    ``slot_wait_s(preempting_requests_per_s=...)``).

    Until a key has been watched for ``window_s`` (from its first request), the rate is over the
    time it has been watched, at least ``min_span_s``: a window that is mostly from before anything
    arrived would dilute a burst that started with it (premium arriving at 0.9x of the capacity
    measured as 0.3x three seconds in, and the batch requests admitted on that waited 37 s behind
    it)."""

    def __init__(self, window_s: float = 10.0, min_span_s: float = 1.0) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self._since: dict[object, float] = {}
        self._events: dict[object, deque[tuple[float, int, float]]] = {}
        self._tokens: dict[object, dict[int, float]] = {}
        self._requests: dict[object, dict[int, int]] = {}

    def note(self, key: object, now_s: float, priority: int, tokens: float) -> None:
        self._since.setdefault(key, now_s)
        self._events.setdefault(key, deque()).append((now_s, priority, tokens))
        by_tokens, by_requests = self._tokens.setdefault(key, {}), self._requests.setdefault(key, {})
        by_tokens[priority] = by_tokens.get(priority, 0.0) + tokens
        by_requests[priority] = by_requests.get(priority, 0) + 1
        self._expire(key, now_s)

    def requests_per_s_by_priority_above(self, key: object, priority: int, now_s: float) -> dict[int, float]:
        """``requests_per_s_above``, by priority."""
        if key not in self._events:
            return {}
        self._expire(key, now_s)
        span = self._span(key, now_s)
        return {p: n / span for p, n in self._requests[key].items() if p < priority and n > 0}

    def tokens_per_s_above(self, key: object, priority: int, now_s: float) -> float:
        """Tokens per second admitted to ``key`` at priorities higher than ``priority``."""
        return self._rate_above(self._tokens, key, priority, now_s)

    def requests_per_s_above(self, key: object, priority: int, now_s: float) -> float:
        """Requests per second admitted to ``key`` at priorities higher than ``priority``."""
        return sum(self.requests_per_s_by_priority_above(key, priority, now_s).values())

    def forget(self, keep: set) -> None:
        """Drop the prefills not in ``keep`` (workers that left)."""
        for key in [k for k in self._events if k not in keep]:
            del self._events[key], self._tokens[key], self._requests[key], self._since[key]

    def span_s(self, key: object, now_s: float) -> float | None:
        """The time ``key``'s rates are over: the window, or less while it has been watched for
        less (at least ``min_span_s``); None for a key nothing was admitted to."""
        return self._span(key, now_s) if key in self._since else None

    def _span(self, key: object, now_s: float) -> float:
        return min(self.window_s, max(now_s - self._since[key], self.min_span_s))

    def _rate_above(self, sums: dict, key: object, priority: int, now_s: float) -> float:
        if key not in self._events:
            return 0.0
        self._expire(key, now_s)
        return max(sum(n for p, n in sums[key].items() if p < priority), 0.0) / self._span(key, now_s)

    def _expire(self, key: object, now_s: float) -> None:
        events, by_tokens, by_requests = self._events[key], self._tokens[key], self._requests[key]
        while events and events[0][0] <= now_s - self.window_s:
            _, priority, tokens = events.popleft()
            by_tokens[priority] -= tokens
            by_requests[priority] -= 1


class Turnover:
    """Slots freed per second on each worker while it had none to spare, from its load reports:
    between two consecutive reports that both show its running and waiting requests filling every
    slot, the requests that ended (received less running less waiting) over the time between
    them, summed over the last ``window_s``. None until ``min_span_s`` of such time and
    ``min_ended`` requests ending in it are seen (a batch of long answers that frees nothing for a
    few seconds is left to the estimate from output lengths, not called never freeing)."""

    def __init__(self, window_s: float = 10.0, min_span_s: float = 2.0, min_ended: int = 3) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.min_ended = min_ended
        self._last: dict[object, tuple[float, int, bool]] = {}
        self._spans: dict[object, deque[tuple[float, float, int]]] = {}

    def note(self, key: object, t: float, num_ended: int, saturated: bool) -> None:
        last = self._last.get(key)
        self._last[key] = (t, num_ended, saturated)
        if last is None or t <= last[0]:
            return
        if saturated and last[2]:
            self._spans.setdefault(key, deque()).append((t, t - last[0], max(num_ended - last[1], 0)))

    def frees_per_s(self, key: object, now_s: float) -> float | None:
        spans = self._spans.get(key)
        if not spans:
            return None
        while spans and spans[0][0] <= now_s - self.window_s:
            spans.popleft()
        total, ended = sum(dt for _, dt, _ in spans), sum(n for _, _, n in spans)
        return ended / total if total >= self.min_span_s and ended >= self.min_ended else None

    def forget(self, keep: set) -> None:
        for key in [k for k in self._last if k not in keep]:
            self._last.pop(key, None)
            self._spans.pop(key, None)


class Admitter:
    """The tier rules, plus the memory that makes shedding ordered: the last SLO rejection time of
    each priority."""

    def __init__(self, cfg: AdmissionConfig = AdmissionConfig()) -> None:
        self.cfg = cfg
        self._missed_at: dict[int, float] = {}  # priority -> last SLO rejection

    def decide_first(self, candidates: Iterable[AdmissionInput]) -> tuple[int, AdmissionDecision]:
        """The request on each candidate worker in turn (the routing's choice first, then the next
        cheapest), admitted on the first that meets its tier's rules: a prompt whose predicted TTFT
        misses on the worker holding its prefix, or whose one more row would push that worker's ITL
        over a higher tier's budget, may still be served in time by another. ``candidates`` is
        consumed lazily, so a request admitted on the first is observed once. Rejected on all: the
        first candidate's rejection, and only then is an SLO miss remembered (the tier is short of
        capacity everywhere it could go, so the lower tiers are shed). Returns the index of the
        candidate admitted on (0 when rejected) and the decision."""
        first: AdmissionDecision | None = None
        missed_at = None
        for k, inp in enumerate(candidates):
            decision = self.decide(inp, remember_miss=False)
            if decision.admitted:
                return k, decision
            if decision.code == "slo":
                missed_at = inp
            if first is None:
                first = decision
            if not decision.worker_bound:
                break   # the same on every worker: too long, the tier's queue full, the tier shed
        if first is None:
            raise ValueError("no candidate worker to decide on")
        if missed_at is not None:
            self._missed_at[self.cfg.qos.tiers[missed_at.tier].priority] = missed_at.now_s
        return 0, first

    def decide(self, inp: AdmissionInput, remember_miss: bool = True) -> AdmissionDecision:
        """The tier rules on one worker. An SLO rejection sheds the lower tiers for ``shed_hold_s``
        unless ``remember_miss`` is False (``decide_first`` remembers it once every candidate
        missed)."""
        cfg = self.cfg
        tier = cfg.qos.tiers.get(inp.tier)
        if tier is None:
            raise ValueError(f"unknown tier {inp.tier!r}; tiers: {sorted(cfg.qos.tiers)}")
        ttft = predict_ttft_s(inp, cfg.arrival_margin_sd)
        if inp.prompt_tokens > cfg.max_prompt_tokens:
            return AdmissionDecision(False, f"prompt {inp.prompt_tokens} > {cfg.max_prompt_tokens} tokens",
                                     ttft, code="prompt_too_long")
        slo = tier.ttft_slo_s
        alone_s = own_prefill_alone_s(inp)
        if slo is not None and alone_s is not None and alone_s > slo:
            # infeasible however idle the cluster: not a miss that shedding lower tiers could fix
            return AdmissionDecision(False, f"its prefill alone takes {alone_s:.2f}s > {inp.tier} "
                                            f"SLO {slo:.2f}s", ttft, code="prompt_too_long",
                                     worker_bound=True)
        if tier.max_queued is not None and inp.queued_requests >= tier.max_queued:
            return self._reject(f"tier {inp.tier} has {inp.queued_requests} queued (max {tier.max_queued})",
                                ttft, cfg.min_retry_after_s, "tier_queue_full")
        shed_until = max((at + cfg.shed_hold_s for p, at in self._missed_at.items() if p < tier.priority),
                         default=-math.inf)
        if inp.now_s < shed_until:
            return self._reject(f"tier {inp.tier} shed while a higher tier misses its SLO", ttft,
                                shed_until - inp.now_s, "shedding")
        budget = self._itl_budget_s(tier.priority)
        itl = predict_itl_s(inp)
        if budget is not None and itl is not None and itl > budget:
            return self._reject(f"tier {inp.tier} shed: ITL would reach {itl * 1000:.0f}ms, over the "
                                f"{budget * 1000:.0f}ms budget of a higher tier", ttft, cfg.min_retry_after_s,
                                "shedding", worker_bound=True)
        if slo is not None and ttft is not None and ttft > slo:
            if remember_miss:
                self._missed_at[tier.priority] = inp.now_s
            return self._reject(f"predicted TTFT {ttft:.2f}s > {inp.tier} SLO {slo:.2f}s", ttft, ttft - slo, "slo",
                                worker_bound=True)
        if inp.deadline_s is not None:
            # the request's own bound: a miss sheds no other tier (its SLO may still be met)
            finish = predict_finish_s(inp, ttft)
            if inp.deadline_s <= 0 or (finish is not None and finish > inp.deadline_s):
                shown = "now" if finish is None else f"{finish:.2f}s"
                return self._reject(f"predicted to finish in {shown} (up to {inp.max_output_tokens} tokens), after "
                                    f"its deadline in {max(inp.deadline_s, 0):.2f}s", ttft,
                                    (finish or 0.0) - inp.deadline_s, "deadline", worker_bound=True)
        return AdmissionDecision(True, "ok", ttft)

    def _itl_budget_s(self, priority: int) -> float | None:
        """The tightest ITL budget of the tiers above ``priority``."""
        budgets = [t.itl_slo_s for t in self.cfg.qos.tiers.values() if t.priority < priority and t.itl_slo_s]
        return min(budgets, default=None)

    def _reject(self, reason: str, ttft: float | None, wait_s: float, code: RejectCode,
                worker_bound: bool = False) -> AdmissionDecision:
        retry = max(wait_s, self.cfg.min_retry_after_s) if math.isfinite(wait_s) else self.cfg.min_retry_after_s
        return AdmissionDecision(False, reason, ttft, retry, code, worker_bound)
