"""The leading-prefix walk: how many of a prompt's first blocks each worker holds.

Block hashes are chained, so a worker that lacks block ``i`` cannot reuse any later block even if
it holds them: a worker's overlap is the length of the unbroken run of blocks it holds from the
start. The walk visits the prompt's blocks in order and stops at the first block that no worker
still in the run holds. The kv-index (over Redis) and the simulator (over a dict) walk with this.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TypeVar

W = TypeVar("W", bound=Hashable)


def extend_overlap(counts: dict[W, int], position: int, holders: Iterable[W]) -> bool:
    """One step of the walk over block ``position`` (0-based), held by ``holders``.

    A holder that held every earlier block now holds ``position + 1``; ``counts`` is updated in
    place. Returns False when nobody extended the run: the walk is over (later blocks cannot count).
    """
    extended = [w for w in holders if counts.get(w, 0) == position]
    for w in extended:
        counts[w] = position + 1
    return bool(extended)


def leading_overlap(holders_per_block: Iterable[Iterable[W]]) -> dict[W, int]:
    """worker → leading blocks held, from each block's holders in prompt order. The iterable is
    consumed lazily and only up to the first block that ends the walk."""
    counts: dict[W, int] = {}
    for position, holders in enumerate(holders_per_block):
        if not extend_overlap(counts, position, holders):
            break
    return counts
