"""Exponential backoff for the retry loops that wait longer after each failure: the wait after the
n-th failure in a row is ``initial_s * factor ** (n - 1)``, capped at ``max_s``. No jitter: the
retriers are a handful of processes of one stack, not a fleet of clients stampeding one server.

Pure: it says how long to wait, the caller sleeps (``Bus.connect``, ``Link``'s resume hooks) or
schedules a restart at ``now_s + delay`` (``tandem up``'s supervisor). It lives beside the bus, its
first users, and imports nothing of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial_s: float
    factor: float
    max_s: float

    def delay_s(self, num_failures: int) -> float:
        """The wait after ``num_failures`` failures in a row (1 for the first)."""
        assert num_failures >= 1, f"no failure to back off from ({num_failures})"
        try:
            return min(self.max_s, self.initial_s * self.factor ** (num_failures - 1))
        except OverflowError:  # factor ** n beyond a float (over a thousand doublings): far past the cap
            return self.max_s

    def delays(self) -> Iterator[float]:
        """The wait after each failure of an endless run of them: ``delay_s(1)``, ``delay_s(2)``, ..."""
        return map(self.delay_s, itertools.count(1))
