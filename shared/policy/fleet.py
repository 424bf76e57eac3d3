"""Fleet size: when to start a worker process and when to stop one (``tandem up --autoscale``).

The same observations as the split (``shared.policy.autoscale.TickInput``) give the demand in
workers' worth of capacity; utilisation is that over the fleet. One worker is added when
utilisation reaches ``scale_up_at`` or requests queue on the workers (``max_waiting_per_worker``
each on average, in every sample of the measuring window: measured demand cannot exceed what the
fleet computes, so a saturated fleet shows itself by its queues, while a request waiting one step
for a free slot is no sign of saturation, so only requests beyond the free slots count); one is removed when the
fleet without it would still be at most ``scale_down_at`` utilised, nothing queues, and (a decode worker)
the others' slots hold every request in flight. The gap between the two thresholds is the
hysteresis (after a removal utilisation is at most ``scale_down_at``, below ``scale_up_at``);
``cooldown_s`` separates changes, counted from when the last one is done (``hold``). A fleet below
``min_workers`` is left as it is: a worker missing from it has crashed (``tandem up``'s supervisor
is already restarting it) or missed its heartbeats on a busy machine, and with no worker ready every
threshold would read as met.

The role of a new worker is the one whose workers are the busier (decode while the fleet has no
prefill worker: decode workers prefill locally, and the split is the ratio autoscaler's job); the
role that gives one up is the less busy one that stays within its own minimum.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.policy.autoscale import TickInput, workers_needed


@dataclass(frozen=True)
class FleetConfig:
    min_workers: int
    max_workers: int
    scale_up_at: float = 0.8
    scale_down_at: float = 0.4
    max_waiting_per_worker: float = 1.0
    cooldown_s: float = 60.0
    min_prefill: int = 0
    min_decode: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) must be >= 1 and <= max_workers ({self.max_workers})")
        if not 0 <= self.scale_down_at < self.scale_up_at:
            raise ValueError(f"scale_down_at ({self.scale_down_at}) must be below scale_up_at ({self.scale_up_at})")


@dataclass(frozen=True)
class FleetDecision:
    delta: int            # +1: start a worker of ``role``; -1: stop one; 0: keep the fleet
    role: str | None      # "decode" | "prefill" when delta != 0
    reason: str


class FleetAutoscaler:
    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self._last_change_s: float | None = None

    def tick(self, inp: TickInput) -> FleetDecision:
        cfg = self.cfg
        total = inp.num_prefill + inp.num_decode
        if total > cfg.max_workers:
            return self._change(inp, -1, self._role_to_stop(inp), f"{total} workers, above max_workers {cfg.max_workers}")
        if self._last_change_s is not None and inp.now_s - self._last_change_s < cfg.cooldown_s:
            return FleetDecision(0, None, "fleet cooling down")
        if total < cfg.min_workers:
            return FleetDecision(0, None, f"{total} ready, below min_workers {cfg.min_workers}: "
                                          f"waiting for the missing to come back")
        need = sum(workers_needed(inp))
        usage = f"utilisation {need / max(total, 1):.2f}, {inp.num_waiting / max(total, 1):.1f} waiting per worker"
        queued = inp.num_waiting if inp.num_waiting_sustained is None else inp.num_waiting_sustained
        if total < cfg.max_workers and (need >= cfg.scale_up_at * total
                                        or queued >= cfg.max_waiting_per_worker * total):
            return self._change(inp, +1, self._role_to_start(inp), f"{usage}: scale up to {total + 1}")
        role = self._role_to_stop(inp)
        if (total > cfg.min_workers and role is not None and inp.num_waiting == 0
                and need <= cfg.scale_down_at * (total - 1) and self._rest_holds_in_flight(inp, role)):
            return self._change(inp, -1, role, f"{usage}: scale down to {total - 1} "
                                               f"(utilisation {need / (total - 1):.2f} without one)")
        return FleetDecision(0, None, f"{usage}: fleet of {total} kept")

    def hold(self, now_s: float) -> None:
        """A change is still being carried out: the cooldown counts from when it is done."""
        self._last_change_s = now_s

    def _change(self, inp: TickInput, delta: int, role: str | None, reason: str) -> FleetDecision:
        if role is None:
            return FleetDecision(0, None, f"{reason}, but every role is at its minimum")
        self._last_change_s = inp.now_s
        return FleetDecision(delta, role, reason)

    @staticmethod
    def _rest_holds_in_flight(inp: TickInput, role: str) -> bool:
        """Without one decode worker, the others' slots still hold every request in flight."""
        if role != "decode" or inp.decode_slots_per_worker is None:
            return True
        return inp.num_decode_in_flight <= inp.decode_slots_per_worker * (inp.num_decode - 1)

    def _role_to_start(self, inp: TickInput) -> str:
        if inp.num_prefill == 0:
            return "decode"
        need_p, need_d = workers_needed(inp)
        return "prefill" if need_p / inp.num_prefill > need_d / max(inp.num_decode, 1) else "decode"

    def _role_to_stop(self, inp: TickInput) -> str | None:
        need_p, need_d = workers_needed(inp)
        can_p, can_d = inp.num_prefill > self.cfg.min_prefill, inp.num_decode > self.cfg.min_decode
        if can_p and can_d:
            return "prefill" if need_p / inp.num_prefill < need_d / inp.num_decode else "decode"
        return "prefill" if can_p else "decode" if can_d else None
