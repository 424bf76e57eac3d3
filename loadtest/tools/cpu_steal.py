"""How much of the machine's CPU time the hypervisor took (``steal`` in ``/proc/stat``) over a
stretch of a benchmark. On a shared virtual machine a bench's speed moves with it: the same
capacity burst measured 3.9 and 6.7 req/s within one run, and ``vmstat`` showed 13-51% steal
while a run was slow. A bench records the share per phase so that two phases are compared knowing
what each got.

    before = cpu_times()
    ...
    share = steal_share(before, cpu_times())   # None where /proc/stat is not there

``busy_share`` is the machine's share of CPU time spent working (anything but idle): a bench that
lets targets take turns waits for it to fall before the next target's turn (``bench.serving``).
"""

from __future__ import annotations

from pathlib import Path

# the aggregate "cpu" line's fields, in /proc/stat's order (man 5 proc); guest time is inside user
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(path: Path = Path("/proc/stat")) -> dict[str, int] | None:
    """The machine's cumulative CPU time per kind, in clock ticks; None without ``/proc/stat``."""
    try:
        first = path.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if first[0] != "cpu":
        return None
    return {name: int(value) for name, value in zip(_FIELDS, first[1:])}


def steal_share(before: dict[str, int] | None, after: dict[str, int] | None) -> float | None:
    """Stolen time over all CPU time between two readings (0 on bare metal); None if either is missing
    or no time passed."""
    return _share(before, after, ("steal",))


def busy_share(before: dict[str, int] | None, after: dict[str, int] | None) -> float | None:
    """Time the CPUs spent on anything but idle and iowait over all CPU time between two readings;
    None if either is missing or no time passed."""
    busy = tuple(k for k in _FIELDS if k not in ("idle", "iowait"))
    return _share(before, after, busy)


def _share(before: dict[str, int] | None, after: dict[str, int] | None, kinds: tuple[str, ...]) -> float | None:
    """The ticks of ``kinds`` over all ticks between two readings; None if either is missing or no time passed."""
    if not before or not after:
        return None
    ticks = {k: after.get(k, 0) - before.get(k, 0) for k in _FIELDS}
    total = sum(ticks.values())
    return sum(ticks[k] for k in kinds) / total if total > 0 else None
