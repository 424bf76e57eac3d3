"""Prefill slicing (``prefill_yield``): what each engine step runs, and running it.

A step's eager part (prefill chunks, decode rows not compiled) of a lower priority stops between two
layers when a more urgent request is on its way in (``announce``), or when more urgent decode rows
have waited ``prefill_slice_ms`` for it; it waits in ``ModelRunner.suspended`` and goes on in a later
step, after a step of those decode rows alone if it stopped for them, and after the more urgent
prompts. The engine asks ``plan`` what its next step runs, has ``run`` run it, and updates the
scheduler from what ran (``LLMEngine.step``)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.config import EngineConfig
from shared.engine.model_runner import ModelRunner
from shared.engine.request import RequestStatus
from shared.engine.sampler import SampledToken
from shared.engine.scheduler import Scheduler, SchedulerOutput
from shared.engine.step_stats import StepStats
from shared.engine.step_trace import StepTrace

log = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """What a step runs: ``out`` from the start, or with ``resume`` the suspended part (``out``: its
    entries). An empty ``out`` without ``resume``: nothing runs, yet the engine is not idle (a part
    was dropped, and its requests compute their tokens again in the next step)."""

    out: SchedulerOutput
    resume: bool = False


class PrefillSlicer:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, config: EngineConfig, step_stats: StepStats,
                 step_trace: StepTrace | None, model) -> None:
        """``model``: for the number of its layers in the log."""
        self._runner, self._scheduler, self._config = runner, scheduler, config
        self._step_stats, self._step_trace, self._model = step_stats, step_trace, model
        # the most urgent priority of requests on their way in from another thread (AsyncEngine
        # announces them as they are posted and clears them once they are added): a step's part of a
        # lower priority stops between two layers for them
        self.urgent_pending = math.inf
        # the part's last stop was for decode rows of a more urgent priority (``prefill_slice_ms``): a
        # step of decode rows alone runs before the part goes on
        self._decode_turn = False
        self.clock = time.perf_counter  # for the slices' deadlines

    def announce(self, priority: int) -> None:
        self.urgent_pending = min(self.urgent_pending, priority)

    def clear_announced(self) -> None:
        self.urgent_pending = math.inf

    # -- schedule -----------------------------------------------------------------------------------
    def plan(self) -> StepPlan | None:
        """The next step: with a part suspended, decode rows alone first if it stopped for them, then
        the part unless a more urgent prompt is to be computed; else the scheduler's next step, or
        the part whatever waits when nothing else can run. None: nothing to run."""
        if self._runner.suspended is not None:
            if self._decode_turn:
                self._decode_turn = False
                if (out := self._scheduler.schedule_decodes()).scheduled:
                    return StepPlan(out)
            if self._may_resume(force=False):
                return StepPlan(SchedulerOutput(self._runner.suspended.entries), resume=True)
        out = self._scheduler.schedule()
        if out.scheduled:
            return StepPlan(out)
        if self._runner.suspended is None:
            return None
        if self._may_resume(force=True):  # nothing else can run: it goes on
            return StepPlan(SchedulerOutput(self._runner.suspended.entries), resume=True)
        return StepPlan(SchedulerOutput())

    def _may_resume(self, force: bool) -> bool:
        """Whether the suspended part goes on now: not while a more urgent prompt is to be computed
        (unless ``force``), never once one of its requests ended or was preempted (it is dropped)."""
        part = self._runner.suspended
        if not all(s.request.status is RequestStatus.RUNNING and s.request.num_preemptions == n
                   for s, n in zip(part.entries, part.num_preemptions)):
            # one of its requests was aborted or preempted, so its blocks may be another's now: the
            # part's work is dropped, and its other requests compute those tokens again
            for s in part.entries:
                s.request.suspended = False
            self._runner.suspended = None
            log.debug("a suspended step's part was dropped: one of its requests ended or was preempted")
            return False
        return force or not self._scheduler.has_prompt_work_above(part.priority)

    # -- run ----------------------------------------------------------------------------------------
    def run(self, plan: StepPlan) -> tuple[SchedulerOutput, dict[str, list[SampledToken]]]:
        """Run a planned step: what of it ran to the end and their tokens. The entries of a part that
        stopped are left out (marked ``suspended``); a resumed part that stopped again: nothing."""
        if plan.resume:
            return self._resume(plan.out)
        if not plan.out.scheduled:
            return plan.out, {}
        return self._execute(plan.out)

    def _execute(self, out: SchedulerOutput) -> tuple[SchedulerOutput, dict[str, list[SampledToken]]]:
        now = time.monotonic()
        for s in out.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        interrupt = None if self._runner.suspended is not None else self._interrupt(min(
            (s.request.priority for s in out.scheduled if s.decode_rows), default=math.inf))
        started = time.perf_counter()
        sampled = self._runner.execute(out, interrupt)
        elapsed = time.perf_counter() - started
        part = self._runner.suspended if interrupt is not None else None
        if part is not None:
            for s in part.entries:
                s.request.suspended = True
            paused, out = part.entries, SchedulerOutput([s for s in out.scheduled if not s.request.suspended],
                                                        out.preempted)
            log.debug("step stopped after layer %d of %d for %s more urgent than priority %d",
                      part.state.next_layer, len(self._model.layers),
                      "decode rows" if self._decode_turn else "a request", part.priority)
        if out.scheduled:  # the stopped part's time is recorded when it ends (``_resume``)
            self._step_stats.record(out, elapsed - (part.elapsed_s if part is not None else 0.0))
        if self._step_trace is not None:
            self._step_trace.record(now, elapsed, out, paused if part is not None else ())
        return out, sampled

    def _resume(self, out: SchedulerOutput) -> tuple[SchedulerOutput, dict[str, list[SampledToken]]]:
        """Go on with the suspended part (``out``: its entries)."""
        part = self._runner.suspended
        now, started = time.monotonic(), time.perf_counter()
        sampled = self._runner.resume(self._interrupt(self._scheduler.decode_priority()))
        elapsed = time.perf_counter() - started
        if sampled is None:  # it stopped again
            if self._step_trace is not None:
                self._step_trace.record(now, elapsed, SchedulerOutput(), part.entries)
            return SchedulerOutput(), {}
        for s in part.entries:
            s.request.suspended = False
        self._step_stats.record(out, part.elapsed_s)
        if self._step_trace is not None:
            self._step_trace.record(now, elapsed, out)
        return out, sampled

    def _interrupt(self, decode_priority: float) -> Callable[[int], bool] | None:
        """What a step's part asks between two layers (its most urgent priority ``p``): stop when a
        request more urgent than ``p`` is on its way in, or when decode rows more urgent than ``p``
        (``decode_priority``) have waited ``prefill_slice_ms`` since the step began; None without
        ``prefill_yield``."""
        if not self._config.prefill_yield:
            return None
        self._decode_turn = False
        slice_s = self._config.prefill_slice_ms / 1000 if decode_priority < math.inf else 0.0
        deadline = self.clock() + slice_s

        def interrupt(priority: int) -> bool:
            if self.urgent_pending < priority:
                return True
            if slice_s > 0 and decode_priority < priority and self.clock() >= deadline:
                self._decode_turn = True
                return True
            return False
        return interrupt
