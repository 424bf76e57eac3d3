"""Which priority level of the prefill queue a free prefill slot serves next (pure).

The queue has one JetStream subject per priority level. The rule is strict priority with a bound
on starvation: the highest-priority level with work waiting is served first, except that a level
passed over ``max_skips`` times in a row while it had work waiting goes first. So a lower tier
progresses at least once every ``max_skips + 1`` picks however busy the higher ones are, and under
no contention the order is plain priority.
"""

from __future__ import annotations

from collections.abc import Sequence


class LevelPicker:
    def __init__(self, num_levels: int, max_skips: int = 3) -> None:
        assert num_levels >= 1 and max_skips >= 1, (num_levels, max_skips)
        self.max_skips = max_skips
        self._skips = [0] * num_levels  # consecutive picks that passed over a waiting level

    def pick(self, pending: Sequence[int]) -> int | None:
        """The level to take one message from, given how many wait at each (index = level, 0
        first); None when nothing waits. Counts the pick: call once per message taken."""
        waiting = [level for level, n in enumerate(pending) if n > 0]
        if not waiting:
            return None
        starved = [level for level in waiting if self._skips[level] >= self.max_skips]
        chosen = starved[0] if starved else waiting[0]
        for level in waiting:
            self._skips[level] = 0 if level == chosen else self._skips[level] + 1
        return chosen
