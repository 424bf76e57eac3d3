"""When ``tandem up`` restarts a child that died: the policy, pure (the caller passes ``now_s``).

A crash is any exit but a clean one: exit code 0 is a worker that drained and left on purpose
(SIGTERM, a scale-down ``stop``), and bringing it back would undo that. A crashed child is
started again after an exponential backoff, capped at ``max_s``; a child that keeps crashing at
start-up is retried at the cap for as long as the stack runs. One that ran for ``stable_after_s``
before it died counts as healthy again and restarts after ``initial_s``.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from shared.bus import backoff


@dataclass(frozen=True)
class Backoff(backoff.Backoff):
    """``delay_s(num_consecutive_crashes)``: the wait before a restart."""
    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    stable_after_s: float = 60.0


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class ChildRecord:
    started_at_s: float
    num_restarts: int = 0
    num_consecutive_crashes: int = 0
    restart_at_s: float | None = None   # set while a restart is pending
    has_exited: bool = False


@dataclass(frozen=True)
class ExitDecision:
    name: str
    returncode: int
    ran_for_s: float
    restart_in_s: float | None          # None: not restarted (a clean exit, or a final one)
    num_restarts: int                   # the restart this will be (1 for the first)
    num_consecutive_crashes: int

    def describe(self) -> str:
        """The one log line for this exit."""
        what = f"{self.name} exited ({describe_exit(self.returncode)}) after {self.ran_for_s:.1f}s"
        if self.restart_in_s is None and self.returncode == 0:
            return f"{what}; a clean exit: not restarted"
        if self.restart_in_s is None:
            return f"{what}; not restarted (a restart cannot mend its cause)"
        again = (f", {self.num_consecutive_crashes} crashes in a row" if self.num_consecutive_crashes > 1
                 else "")
        return f"{what}; restart {self.num_restarts} in {self.restart_in_s:g}s{again}"


class RestartPolicy:
    """Per child name: when it started, how often it was restarted, when the next start is due."""

    def __init__(self, backoff: Backoff = Backoff()) -> None:
        self.backoff = backoff
        self._children: dict[str, ChildRecord] = {}

    def started(self, name: str, now_s: float) -> int:
        """Record a start of ``name``; returns its restart count (0 for the first start)."""
        record = self._children.get(name)
        if record is None:
            self._children[name] = ChildRecord(started_at_s=now_s)
            return 0
        record.started_at_s, record.restart_at_s, record.has_exited = now_s, None, False
        return record.num_restarts

    def exited(self, name: str, returncode: int, now_s: float, *, is_crash: bool = False,
               is_final: bool = False) -> ExitDecision:
        """Record the exit; ``is_crash``: restart it even after a clean exit (a server the stack
        cannot work without); ``is_final``: do not restart it whatever the exit code (its cause
        outlives a restart)."""
        record = self._children[name]
        assert not record.has_exited, f"{name} exited twice without a start in between"
        record.has_exited = True
        ran_for_s = now_s - record.started_at_s
        if (returncode == 0 and not is_crash) or is_final:
            return ExitDecision(name, returncode, ran_for_s, None, record.num_restarts,
                                record.num_consecutive_crashes)
        if ran_for_s >= self.backoff.stable_after_s:
            record.num_consecutive_crashes = 0
        record.num_consecutive_crashes += 1
        record.num_restarts += 1
        delay_s = self.backoff.delay_s(record.num_consecutive_crashes)
        record.restart_at_s = now_s + delay_s
        return ExitDecision(name, returncode, ran_for_s, delay_s, record.num_restarts,
                            record.num_consecutive_crashes)

    def has_exited(self, name: str) -> bool:
        return self._children[name].has_exited

    def due(self, now_s: float) -> list[str]:
        """Children whose restart is due, in the order they were first started."""
        return [name for name, r in self._children.items()
                if r.restart_at_s is not None and r.restart_at_s <= now_s]

    def num_restarts(self, name: str) -> int:
        record = self._children.get(name)
        return record.num_restarts if record else 0
