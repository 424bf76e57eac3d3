"""From what the cluster reports to what the autoscaling policy takes, and from its decision to the
workers that act on it. Pure: the autoscaler service feeds it two successive samples of every
worker's cumulative counters, tests feed it numbers, the simulator its own window totals.

Demand is measured, not predicted: prefill demand is the uncached prompt tokens the fleet computed
per second (prompt minus cached-prefix tokens, summed over every worker: a remotely prefilled prompt
is counted by the prefill worker that computed it, not again by its decode worker) plus the growth
of the prefill backlog still queued on the workers (work that arrived but was not computed yet);
decode demand is the output tokens decode workers produced per second. Of the prefill demand, the
part decode workers compute themselves whatever the split (prompts too short for a remote prefill)
is counted apart: a prefill worker cannot take it. Capacity per worker is the
measured prefill rate where workers report one, otherwise the configured figure; decode capacity
is configured (a decode worker's reports show what it does, not what it could do).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shared.policy.autoscale import ScalingDecision, TickInput

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class WorkerSample:
    """One worker's latest report: cumulative engine counters at ``timestamp`` (its own clock)."""

    worker_id: str
    role: str                      # "decode" | "prefill"
    is_ready: bool                 # registered ready (not starting, not draining)
    timestamp: float
    num_prompt_tokens: int         # cumulative, like the engine's counters
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    num_queued_prefill_tokens: int = 0   # now, not cumulative
    num_in_flight: int = 0               # running + waiting: what a flip would have to drain
    num_local_only_prompt_tokens: int = 0  # cumulative: uncached tokens of prompts too short to prefill remotely
    num_waiting: int = 0                 # queued, not yet running: the fleet is saturated
    prefill_tokens_per_s: float | None = None
    max_num_seqs: int | None = None      # its sequence slots (None: not reported)
    has_report: bool = True              # False: registered, no load report yet (counters zero)


@dataclass(frozen=True)
class Capacities:
    """Per-worker throughput used where nothing is measured (tokens per second)."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float


@dataclass(frozen=True)
class Demand:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    interval_s: float  # the span the counters covered (0: nothing to compare yet)
    local_prefill_tokens_per_s: float = 0.0  # of prefill_tokens_per_s, what only decode workers compute


def measure_demand(previous: Mapping[str, WorkerSample], current: Iterable[WorkerSample]) -> Demand:
    """Token rates between two samples of the same workers. A worker seen only once, not reporting
    in the earlier sample (``has_report`` False), or whose
    counters went backwards (a restart under the same id) contributes nothing. The counters are
    the engine's, so they span a role flip: prompt tokens computed are prefill work in either
    role, output tokens count as decode work only if the worker decoded at both ends. The interval
    is the longest any worker's counters covered, so rates are not inflated by a worker that
    reported twice quickly."""
    prefill = decode = backlog_growth = local = 0.0
    interval = 0.0
    for now in current:
        before = previous.get(now.worker_id)
        # a worker with no report yet has no counters to subtract: its first report's totals
        # (warm-up included) are not a window's work, and an interval counted from timestamp 0
        # would dilute every other worker's rate to nothing
        if before is None or not before.has_report or now.timestamp <= before.timestamp:
            continue
        computed = (now.num_prompt_tokens - now.num_cached_prompt_tokens) \
            - (before.num_prompt_tokens - before.num_cached_prompt_tokens)
        generated = now.num_generated_tokens - before.num_generated_tokens
        if computed < 0 or generated < 0:
            continue
        interval = max(interval, now.timestamp - before.timestamp)
        prefill += computed
        # a flip starts the role's counter again: a worker whose count went back adds none this window
        local += max(now.num_local_only_prompt_tokens - before.num_local_only_prompt_tokens, 0)
        backlog_growth += now.num_queued_prefill_tokens - before.num_queued_prefill_tokens
        if now.role == DECODE and before.role == DECODE:
            decode += generated  # a prefill worker's one sampled token per prompt is not decode work
    if interval <= 0:
        return Demand(0.0, 0.0, 0.0)
    total = prefill + max(backlog_growth, 0.0)
    return Demand(total / interval, decode / interval, interval, min(local, total) / interval)


def tick_input(now_s: float, demand: Demand, samples: Iterable[WorkerSample], defaults: Capacities,
               num_waiting_sustained: int | None = None) -> TickInput:
    """The policy's observations: ready workers per role, demand, and per-worker capacity (the mean
    measured prefill rate of the workers reporting one, else ``defaults``)."""
    samples = list(samples)
    ready = [s for s in samples if s.is_ready]
    rates = [s.prefill_tokens_per_s for s in samples if s.prefill_tokens_per_s]
    prefill_capacity = sum(rates) / len(rates) if rates else defaults.prefill_tokens_per_s
    return TickInput(now_s=now_s, num_prefill=sum(s.role == PREFILL for s in ready),
                     num_decode=sum(s.role == DECODE for s in ready),
                     prefill_tokens_per_s=demand.prefill_tokens_per_s,
                     local_prefill_tokens_per_s=demand.local_prefill_tokens_per_s,
                     decode_tokens_per_s=demand.decode_tokens_per_s,
                     prefill_capacity_tokens_per_s=prefill_capacity,
                     decode_capacity_tokens_per_s=defaults.decode_tokens_per_s,
                     num_waiting=sum(s.num_waiting for s in ready), num_waiting_sustained=num_waiting_sustained,
                     num_decode_in_flight=sum(s.num_in_flight for s in ready if s.role == DECODE),
                     decode_slots_per_worker=_slots([s for s in ready if s.role == DECODE]))


def _slots(samples: list[WorkerSample]) -> int | None:
    """The fewest sequence slots of ``samples`` (None if any did not report them)."""
    if not samples or any(s.max_num_seqs is None for s in samples):
        return None
    return min(s.max_num_seqs for s in samples)


def num_queued(samples: Iterable[WorkerSample]) -> int:
    """Requests queued on the ready workers among ``samples`` beyond their free sequence slots. A
    request counts as waiting from its arrival until the next step schedules it, so on a worker
    with a free slot (a slow step on a busy machine) it waits without the worker being saturated."""
    return sum(_queued(s) for s in samples if s.is_ready)


def _queued(s: WorkerSample) -> int:
    if s.max_num_seqs is None:
        return s.num_waiting
    return max(0, min(s.num_waiting, s.num_in_flight - s.max_num_seqs))


@dataclass(frozen=True)
class Flip:
    worker_id: str
    to_role: str


def choose_flips(decision: ScalingDecision, samples: Iterable[WorkerSample]) -> list[Flip]:
    """The workers that carry out ``decision.flips``: ready workers of the role giving workers up,
    those with the least in flight first (they drain soonest), then by id (a stable choice)."""
    if decision.flips == 0:
        return []
    source, target = (DECODE, PREFILL) if decision.flips > 0 else (PREFILL, DECODE)
    return [Flip(worker_id, target) for worker_id in least_busy(samples, source)[:abs(decision.flips)]]


def least_busy(samples: Iterable[WorkerSample], role: str) -> list[str]:
    """Ready workers of ``role``, those with the least in flight first (they drain soonest), then
    by id (a stable choice): the ones to flip or stop."""
    candidates = sorted((s for s in samples if s.is_ready and s.role == role),
                        key=lambda s: (s.num_in_flight, s.worker_id))
    return [s.worker_id for s in candidates]


def in_transition(samples: Iterable[WorkerSample]) -> list[str]:
    """Workers neither ready nor gone (starting, draining, flipping): while any is, a tick would
    count the fleet wrong, so the autoscaler waits."""
    return sorted(s.worker_id for s in samples if not s.is_ready)
