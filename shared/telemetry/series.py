"""The gateway's recent history for the live dashboard: per-second buckets of TTFT and ITL samples,
finished requests, generated tokens and rejections by tier, over the last ``horizon_s`` seconds,
summarised into points of ``step_s`` seconds (percentiles and rates).

Prometheus histograms answer the same questions for Prometheus; this exists because the dashboard
must work with nothing else running. Pure: every call takes ``now`` (seconds, any clock).
"""

from __future__ import annotations

import random
from collections import defaultdict, deque
from dataclasses import dataclass, field

from shared.telemetry.measure import percentiles

MAX_SAMPLES_PER_SECOND = 2000  # ITL at high throughput: a uniform sample keeps percentiles honest


@dataclass
class _Second:
    t: int
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    num_itl_seen: int = 0
    num_finished: int = 0
    num_tokens: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: defaultdict(int))


@dataclass(frozen=True)
class SeriesPoint:
    """One step of history: ``t`` its start; latencies in seconds (None: no sample in the step)."""

    t: float
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p90: float | None
    itl_p99: float | None
    requests_per_s: float
    tokens_per_s: float
    rejected: dict[str, int]


class RecentSeries:
    def __init__(self, horizon_s: int = 300, seed: int = 0) -> None:
        self.horizon_s = horizon_s
        self._seconds: deque[_Second] = deque()
        self._rng = random.Random(seed)
        self.rejected_total: dict[str, int] = defaultdict(int)  # by tier, since start

    def _at(self, now: float) -> _Second:
        t = int(now)
        if not self._seconds or self._seconds[-1].t != t:
            self._seconds.append(_Second(t))
            while self._seconds[0].t <= t - self.horizon_s:
                self._seconds.popleft()
        return self._seconds[-1]

    def observe_ttft(self, now: float, seconds: float) -> None:
        self._at(now).ttft.append(seconds)

    def observe_itl(self, now: float, seconds: float) -> None:
        second = self._at(now)
        second.num_itl_seen += 1
        if len(second.itl) < MAX_SAMPLES_PER_SECOND:
            second.itl.append(seconds)
        elif (i := self._rng.randrange(second.num_itl_seen)) < MAX_SAMPLES_PER_SECOND:
            second.itl[i] = seconds  # reservoir sampling: each observation kept with equal chance

    def observe_finished(self, now: float, num_tokens: int) -> None:
        second = self._at(now)
        second.num_finished += 1
        second.num_tokens += num_tokens

    def observe_rejected(self, now: float, tier: str) -> None:
        self._at(now).rejected[tier] += 1
        self.rejected_total[tier] += 1

    def points(self, now: float, step_s: int = 5) -> list[SeriesPoint]:
        """The last ``horizon_s`` as points of ``step_s`` seconds, oldest first; the current,
        incomplete step last (its rates over the seconds elapsed so far)."""
        end = int(now) + 1
        # aligned, so a point keeps its span from one call to the next; the first lies wholly inside
        # the horizon (its seconds are all still kept)
        first = -(-(end - self.horizon_s) // step_s) * step_s
        steps: dict[int, list[_Second]] = {start: [] for start in range(first, end, step_s)}
        for second in self._seconds:
            if second.t >= first:
                steps[first + (second.t - first) // step_s * step_s].append(second)
        return [_point(start, group, min(step_s, end - start)) for start, group in steps.items()]


def _point(start: int, seconds: list[_Second], span_s: int) -> SeriesPoint:
    ttft = [v for s in seconds for v in s.ttft]
    itl = [v for s in seconds for v in s.itl]
    rejected: dict[str, int] = defaultdict(int)
    for s in seconds:
        for tier, n in s.rejected.items():
            rejected[tier] += n
    ttft_q, itl_q = percentiles(ttft), percentiles(itl)
    return SeriesPoint(
        t=float(start), ttft_p50=ttft_q["p50"], ttft_p90=ttft_q["p90"], ttft_p99=ttft_q["p99"],
        itl_p50=itl_q["p50"], itl_p90=itl_q["p90"], itl_p99=itl_q["p99"],
        requests_per_s=sum(s.num_finished for s in seconds) / span_s,
        tokens_per_s=sum(s.num_tokens for s in seconds) / span_s, rejected=dict(rejected))
