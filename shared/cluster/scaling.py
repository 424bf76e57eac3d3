"""The autoscaler's tick, minus the I/O: from the cluster view to the policy's decision and the
workers that carry it out, and the record of what was decided and done (for ``tandem status``).
The service sends the control requests; this module never touches the bus.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.policy.autoscale import RatioAutoscaler, ScalingDecision, TickInput
from shared.policy.autoscale_inputs import (Capacities, Flip, WorkerSample, choose_flips, in_transition,
                                            measure_demand, tick_input)
from shared.protocol.workers import ScalingAction, ScalingDecisionRecord, ScalingStatus, WorkerStatus

MAX_RECORDS = 20


def worker_sample(status: WorkerStatus) -> WorkerSample:
    """A registry entry and its latest load report as the adapter's sample (zeros before the first
    report: such a worker counts in the fleet but adds no rates)."""
    info, load = status.info, status.load
    if load is None:
        return WorkerSample(info.worker_id, info.role, info.state == "ready", 0.0, 0, 0, 0)
    # the registry's role, and the engine's counters (which span flips) from the latest report
    return WorkerSample(
        worker_id=info.worker_id, role=info.role, is_ready=info.state == "ready", timestamp=load.timestamp,
        num_prompt_tokens=load.num_prompt_tokens_total, num_cached_prompt_tokens=load.num_cached_prompt_tokens_total,
        num_generated_tokens=load.num_generated_tokens_total,
        num_queued_prefill_tokens=sum(load.queued_prefill_tokens.values()),
        num_in_flight=load.num_running + load.num_waiting, prefill_tokens_per_s=load.prefill_tokens_per_s)


@dataclass(frozen=True)
class ScalingPlan:
    now_s: float
    reason: str
    tick: TickInput | None = None           # None: the policy was not asked (see reason)
    decision: ScalingDecision | None = None
    flips: tuple[Flip, ...] = ()

    def describe(self) -> str:
        """One log line: what was measured, what the policy said, what will be done."""
        flips = "; flipping " + ", ".join(f"{f.worker_id} to {f.to_role}" for f in self.flips) if self.flips else ""
        if self.tick is None:
            return self.reason
        t = self.tick
        return (f"{t.num_prefill} prefill + {t.num_decode} decode; demand {t.prefill_tokens_per_s:.0f} prompt tok/s "
                f"(capacity {t.prefill_capacity_tokens_per_s:.0f}/worker), {t.decode_tokens_per_s:.0f} output tok/s "
                f"(capacity {t.decode_capacity_tokens_per_s:.0f}/worker): {self.reason}{flips}")


class Autoscaling:
    """Samples over the measuring window, the policy (with its cooldown), and recent decisions.

    Demand is measured over ``window_s`` (between this tick's samples and the oldest kept within
    it), not between two ticks: at a few requests per tick, one tick's counts are mostly noise
    (a prompt counted when it is prefilled, its output tokens over the following ticks)."""

    def __init__(self, policy: RatioAutoscaler, defaults: Capacities, window_s: float) -> None:
        self.policy = policy
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
        samples = [worker_sample(w) for w in workers]
        while self._history and now_s - self._history[0][0] > self.window_s:
            self._history.popleft()
        demand = measure_demand(self._history[0][1] if self._history else {}, samples)
        self._history.append((now_s, {s.worker_id: s for s in samples}))
        if busy := in_transition(samples):
            self.policy.hold(now_s)
            return self._keep(ScalingPlan(now_s, f"waiting for {', '.join(busy)} (starting, draining or flipping)"))
        if demand.interval_s == 0:
            return self._keep(ScalingPlan(now_s, "no load reports to compare yet"))
        inp = tick_input(now_s, demand, samples, self.defaults)
        decision = self.policy.tick(inp)
        plan = ScalingPlan(now_s, decision.reason, inp, decision, tuple(choose_flips(decision, samples)))
        self._last_decision = _record(plan, [])
        return self._keep(plan)

    def _keep(self, plan: ScalingPlan) -> ScalingPlan:
        self._last = plan
        return plan

    def record(self, plan: ScalingPlan, actions: list[ScalingAction]) -> ScalingDecisionRecord | None:
        """Remember a decision that changed something (or tried to); a quiet tick is only ``last``."""
        if plan.decision is None or plan.decision.flips == 0:
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
        prefill_tokens_per_s=inp.prefill_tokens_per_s, decode_tokens_per_s=inp.decode_tokens_per_s,
        prefill_capacity_tokens_per_s=inp.prefill_capacity_tokens_per_s,
        decode_capacity_tokens_per_s=inp.decode_capacity_tokens_per_s, actions=actions)
