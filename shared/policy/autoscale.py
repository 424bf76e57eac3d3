"""Autoscaling: how many workers should prefill and how many decode (a fixed fleet that flips roles).

Each tick compares demand with per-worker capacity in both phases: prefill demand is uncached
prompt tokens per second, decode demand is output tokens per second. Prompts too short for a
remote prefill are prefilled by decode workers whatever the split (conditional disaggregation):
that part of the prefill demand counts on the decode side. The fleet is split in the
ratio of the workers each phase needs; a change is made only when it moves at least one worker,
the imbalance exceeds ``hysteresis``, ``cooldown_s`` has passed since the last change (flips
are expensive: the worker drains first), and every tick of the last ``stabilization_s`` asked for
a change the same way (a burst shorter than that is not worth a drain; the smallest change asked
for in it is made, as Kubernetes' autoscaler does in its stabilization window). Like Dynamo's
planner: ``tick`` takes observations and returns a decision; the caller drains and flips.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscaleConfig:
    cooldown_s: float = 60.0
    hysteresis: float = 0.15      # relative change of the prefill share needed to act
    min_prefill: int = 1
    min_decode: int = 1
    max_flips_per_tick: int = 4
    max_prefill: int | None = None  # None: as many as the fleet has after min_decode
    max_decode: int | None = None   # None: as many as the fleet has after min_prefill
    # act only once the ticks of this long all asked for a change the same way (0: at the first)
    stabilization_s: float = 30.0


@dataclass(frozen=True)
class TickInput:
    now_s: float
    num_prefill: int
    num_decode: int
    prefill_tokens_per_s: float               # uncached prompt tokens arriving per second
    decode_tokens_per_s: float                # output tokens produced (or demanded) per second
    prefill_capacity_tokens_per_s: float      # one prefill worker, within SLO
    decode_capacity_tokens_per_s: float       # one decode worker, at its SLO batch
    # of prefill_tokens_per_s, prompts decode workers prefill themselves whatever the split
    local_prefill_tokens_per_s: float = 0.0
    num_waiting: int = 0                      # requests queued on the workers (not yet running)
    # the fewest queued in any sample of the measuring window (None: only this sample is known):
    # a request counts as queued from its arrival until the next step schedules it, so one sample
    # of a fleet with free slots can show a queue that is gone a step later
    num_waiting_sustained: int | None = None
    # running + waiting on the decode workers, and the sequence slots of each (None: not reported):
    # a decode worker is stopped only if the others could hold what is in flight
    num_decode_in_flight: int = 0
    decode_slots_per_worker: int | None = None


@dataclass(frozen=True)
class ScalingDecision:
    target_prefill: int
    target_decode: int
    flips: int          # > 0: decode workers to turn into prefill; < 0: prefill into decode
    reason: str


def workers_needed(inp: TickInput) -> tuple[float, float]:
    """Prefill and decode demand in workers' worth of capacity. The prompts only decode workers
    prefill are decode-side work, at a prefill worker's rate."""
    prefill_capacity = max(inp.prefill_capacity_tokens_per_s, 1e-9)
    local = min(max(inp.local_prefill_tokens_per_s, 0.0), inp.prefill_tokens_per_s)
    return ((inp.prefill_tokens_per_s - local) / prefill_capacity,
            inp.decode_tokens_per_s / max(inp.decode_capacity_tokens_per_s, 1e-9) + local / prefill_capacity)


class RatioAutoscaler:
    def __init__(self, cfg: AutoscaleConfig = AutoscaleConfig()):
        self.cfg = cfg
        self._last_change_s: float | None = None
        # (tick time, flips asked) of the unbroken run of ticks asking for a change the same way
        self._asked: deque[tuple[float, int]] = deque()

    def tick(self, inp: TickInput) -> ScalingDecision:
        keep = ScalingDecision(inp.num_prefill, inp.num_decode, 0, "")
        if self._last_change_s is not None and inp.now_s - self._last_change_s < self.cfg.cooldown_s:
            return _why(keep, "cooling down")
        wanted = self._wanted(inp)
        if wanted.flips == 0:
            self._asked.clear()
            return wanted
        if self._asked and (self._asked[-1][1] > 0) != (wanted.flips > 0):
            self._asked.clear()
        self._asked.append((inp.now_s, wanted.flips))
        held_s = inp.now_s - self._asked[0][0]
        if held_s < self.cfg.stabilization_s:
            return _why(keep, f"{wanted.reason}; asked for {held_s:.0f} s of {self.cfg.stabilization_s:.0f}")
        flips = min((f for _, f in self._asked), key=abs)  # the smallest change the whole run asked for
        self._asked.clear()
        self._last_change_s = inp.now_s
        return ScalingDecision(inp.num_prefill + flips, inp.num_decode - flips, flips, wanted.reason)

    def _wanted(self, inp: TickInput) -> ScalingDecision:
        """The change this tick's demand asks for, before the stabilization window."""
        total = inp.num_prefill + inp.num_decode
        keep = ScalingDecision(inp.num_prefill, inp.num_decode, 0, "")
        need_p, need_d = workers_needed(inp)
        if need_p + need_d <= 0:
            return _why(keep, "no load")
        share = need_p / (need_p + need_d)
        fewest, most = self._fewest_prefill(total), self._most_prefill(total)
        target_p = min(max(round(share * total), fewest), most)
        current_share = inp.num_prefill / max(total, 1)
        is_within_bounds = fewest <= inp.num_prefill <= most  # outside them, hysteresis does not hold a change back
        if target_p == inp.num_prefill or (is_within_bounds and abs(share - current_share)
                                           < self.cfg.hysteresis * max(current_share, 1 / total)):
            return _why(keep, f"balanced (prefill share {share:.2f} vs {current_share:.2f})")
        if is_within_bounds and min(target_p, inp.num_prefill) > 0:
            # in a small fleet one flip is a large step: the share moves, but the busier side
            # would be about as busy after it (a 3:2 split with demand at 2.5:2.5 stays)
            now = _peak_load(need_p, need_d, inp.num_prefill, total)
            after = _peak_load(need_p, need_d, target_p, total)
            if after > now * (1 - self.cfg.hysteresis):
                return _why(keep, f"no gain (prefill share {share:.2f} vs {current_share:.2f}; busier side "
                                  f"{now:.2f} now, {after:.2f} after)")
        flips = max(min(target_p - inp.num_prefill, self.cfg.max_flips_per_tick), -self.cfg.max_flips_per_tick)
        return ScalingDecision(inp.num_prefill + flips, inp.num_decode - flips, flips,
                               f"prefill share {share:.2f} wanted, have {current_share:.2f}")

    def hold(self, now_s: float) -> None:
        """A change is still being carried out (workers draining, flipping): the cooldown counts
        from when it is done, not from when it was decided; what was asked before it is void."""
        self._last_change_s = now_s
        self._asked.clear()

    def _fewest_prefill(self, total: int) -> int:
        cfg = self.cfg
        return max(cfg.min_prefill, total - cfg.max_decode) if cfg.max_decode is not None else cfg.min_prefill

    def _most_prefill(self, total: int) -> int:
        cfg = self.cfg
        most = total - cfg.min_decode
        return min(most, cfg.max_prefill) if cfg.max_prefill is not None else most


def _peak_load(need_p: float, need_d: float, num_prefill: int, total: int) -> float:
    """Demand per worker on the busier side with ``num_prefill`` of ``total`` workers prefilling
    (both sides at least one worker)."""
    return max(need_p / num_prefill, need_d / (total - num_prefill))


def _why(d: ScalingDecision, reason: str) -> ScalingDecision:
    return ScalingDecision(d.target_prefill, d.target_decode, 0, reason)
