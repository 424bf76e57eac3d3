"""The autoscaler's tick, minus the I/O: from the cluster view to the policy's decision and the
workers that carry it out, and the record of what was decided and done (for ``tandem status``).
The service sends the control requests; this module never touches the bus.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.policy.autoscale import RatioAutoscaler, ScalingDecision, TickInput
from shared.policy.autoscale_inputs import (Capacities, Flip, WorkerSample, choose_flips, in_transition,
                                            least_busy, measure_demand, num_queued, tick_input)
from shared.policy.fleet import FleetAutoscaler, FleetDecision
from shared.protocol.workers import ScalingAction, ScalingDecisionRecord, ScalingStatus, WorkerStatus

MAX_RECORDS = 20
START_TIMEOUT_S = 600.0  # a started worker not ready by then no longer holds the autoscaler back


def worker_sample(status: WorkerStatus) -> WorkerSample:
    """A registry entry and its latest load report as the adapter's sample (zeros before the first
    report: such a worker counts in the fleet but adds no rates)."""
    info, load = status.info, status.load
    if load is None:
        return WorkerSample(info.worker_id, info.role, info.state == "ready", 0.0, 0, 0, 0, has_report=False)
    # the registry's role, and the engine's counters (which span flips) from the latest report
    return WorkerSample(
        worker_id=info.worker_id, role=info.role, is_ready=info.state == "ready", timestamp=load.timestamp,
        num_prompt_tokens=load.num_prompt_tokens_total, num_cached_prompt_tokens=load.num_cached_prompt_tokens_total,
        num_generated_tokens=load.num_generated_tokens_total,
        num_queued_prefill_tokens=sum(load.queued_prefill_tokens.values()),
        num_local_only_prompt_tokens=load.num_local_only_prompt_tokens_total,
        num_in_flight=load.num_running + load.num_waiting, num_waiting=load.num_waiting,
        prefill_tokens_per_s=load.prefill_tokens_per_s, max_num_seqs=load.max_num_seqs)


@dataclass(frozen=True)
class ScalingPlan:
    now_s: float
    reason: str
    tick: TickInput | None = None           # None: the policy was not asked (see reason)
    decision: ScalingDecision | None = None
    flips: tuple[Flip, ...] = ()
    start: str | None = None          # a role: ask tandem up to start a worker of it
    stop: Flip | None = None          # ask tandem up to stop this worker (``to_role``: the role it has)

    @property
    def is_acting(self) -> bool:
        return bool(self.flips) or self.start is not None or self.stop is not None

    def describe(self) -> str:
        """One log line: what was measured, what the policy said, what will be done."""
        flips = "; flipping " + ", ".join(f"{f.worker_id} to {f.to_role}" for f in self.flips) if self.flips else ""
        flips += f"; starting a {self.start} worker" if self.start else ""
        flips += f"; stopping {self.stop.worker_id}" if self.stop else ""
        if self.tick is None:
            return self.reason
        t = self.tick
        local = (f"; {t.local_prefill_tokens_per_s:.0f} of them decode-side only" if t.local_prefill_tokens_per_s
                 else "")
        return (f"{t.num_prefill} prefill + {t.num_decode} decode; demand {t.prefill_tokens_per_s:.0f} prompt tok/s "
                f"(capacity {t.prefill_capacity_tokens_per_s:.0f}/worker{local}), {t.decode_tokens_per_s:.0f} "
                f"output tok/s "
                f"(capacity {t.decode_capacity_tokens_per_s:.0f}/worker): {self.reason}{flips}")


class Autoscaling:
    """Samples over the measuring window, the policy (with its cooldown), and recent decisions.

    Demand is measured over ``window_s`` (between this tick's samples and the oldest kept within
    it), not between two ticks: at a few requests per tick, one tick's counts are mostly noise
    (a prompt counted when it is prefilled, its output tokens over the following ticks)."""

    def __init__(self, policy: RatioAutoscaler, defaults: Capacities, window_s: float,
                 fleet: FleetAutoscaler | None = None) -> None:
        self.policy = policy
        self.fleet = fleet  # None: the fleet's size is not the autoscaler's to change
        self._starting: dict[str, float] = {}  # worker id → when tandem up started it
        self.defaults = defaults
        self.window_s = window_s
        self._history: deque[tuple[float, dict[str, WorkerSample]]] = deque()
        self._records: deque[ScalingDecisionRecord] = deque(maxlen=MAX_RECORDS)
        self._last: ScalingPlan | None = None
        self._last_decision: ScalingDecisionRecord | None = None

    def plan(self, now_s: float, workers: list[WorkerStatus]) -> ScalingPlan:
        """This tick's decision. The policy is not asked while a worker is starting, draining or
        flipping (the fleet's count is about to change; the cooldown restarts when it is done)
        or before two samples give rates."""
        return self.plan_samples(now_s, [worker_sample(w) for w in workers])

    def plan_samples(self, now_s: float, samples: list[WorkerSample]) -> ScalingPlan:
        """``plan`` on the adapter's samples (the simulator builds them from its own counters)."""
        while self._history and now_s - self._history[0][0] > self.window_s:
            self._history.popleft()
        demand = measure_demand(self._history[0][1] if self._history else {}, samples)
        self._history.append((now_s, {s.worker_id: s for s in samples}))
        if busy := in_transition(samples) + self._still_starting(now_s, samples):
            self.policy.hold(now_s)
            if self.fleet is not None:
                self.fleet.hold(now_s)
            return self._keep(ScalingPlan(now_s, f"waiting for {', '.join(busy)} (starting, draining or flipping)"))
        if demand.interval_s == 0:
            return self._keep(ScalingPlan(now_s, "no load reports to compare yet"))
        sustained = min(num_queued(snapshot.values()) for _, snapshot in self._history)
        inp = tick_input(now_s, demand, samples, self.defaults, sustained)
        change = self.fleet.tick(inp) if self.fleet is not None else None
        if change is not None and change.delta != 0:
            plan = self._fleet_plan(inp, change, samples)
        else:
            decision = self.policy.tick(inp)
            reason = f"{change.reason}; {decision.reason}" if change is not None else decision.reason
            plan = ScalingPlan(now_s, reason, inp, decision, tuple(choose_flips(decision, samples)))
        self._last_decision = _record(plan, [])
        return self._keep(plan)

    def _fleet_plan(self, inp: TickInput, change: FleetDecision, samples: list[WorkerSample]) -> ScalingPlan:
        """A start or a stop (the split waits until the fleet has its new size)."""
        self.policy.hold(inp.now_s)
        sign = 1 if change.delta > 0 else -1
        is_prefill = change.role == "prefill"
        decision = ScalingDecision(inp.num_prefill + sign * is_prefill, inp.num_decode + sign * (not is_prefill),
                                   0, change.reason)
        if change.delta > 0:
            return ScalingPlan(inp.now_s, change.reason, inp, decision, start=change.role)
        worker_id = least_busy(samples, change.role)[0]
        return ScalingPlan(inp.now_s, change.reason, inp, decision, stop=Flip(worker_id, change.role))

    def started(self, worker_id: str, now_s: float) -> None:
        """tandem up started ``worker_id``: until it is ready (it registers only once its model is
        loaded) the fleet counts wrong, so no decision is made."""
        self._starting[worker_id] = now_s

    def _still_starting(self, now_s: float, samples: list[WorkerSample]) -> list[str]:
        ready = {s.worker_id for s in samples if s.is_ready}
        self._starting = {w: t for w, t in self._starting.items()
                          if w not in ready and now_s - t < START_TIMEOUT_S}
        return sorted(self._starting)

    def _keep(self, plan: ScalingPlan) -> ScalingPlan:
        self._last = plan
        return plan

    def record(self, plan: ScalingPlan, actions: list[ScalingAction]) -> ScalingDecisionRecord | None:
        """Remember a decision that changed something (or tried to); a quiet tick is only ``last``."""
        if plan.decision is None or not plan.is_acting:
            return None
        record = _record(plan, actions)
        self._records.append(record)
        self._last_decision = record
        return record

    def status(self, enabled: bool) -> ScalingStatus:
        last = self._last
        return ScalingStatus(enabled=enabled, last_reason=last.reason if last else "",
                             last_tick_at=last.now_s if last else None, last_decision=self._last_decision,
                             recent=list(self._records))


def _record(plan: ScalingPlan, actions: list[ScalingAction]) -> ScalingDecisionRecord:
    inp, d = plan.tick, plan.decision
    return ScalingDecisionRecord(
        timestamp=plan.now_s, reason=plan.reason, num_prefill=inp.num_prefill, num_decode=inp.num_decode,
        target_prefill=d.target_prefill, target_decode=d.target_decode,
        prefill_tokens_per_s=inp.prefill_tokens_per_s, local_prefill_tokens_per_s=inp.local_prefill_tokens_per_s,
        decode_tokens_per_s=inp.decode_tokens_per_s,
        prefill_capacity_tokens_per_s=inp.prefill_capacity_tokens_per_s,
        decode_capacity_tokens_per_s=inp.decode_capacity_tokens_per_s, actions=actions)
