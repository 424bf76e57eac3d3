"""Minimal Prometheus metrics (text exposition format 0.0.4) and a recent-window mean.

Small on purpose: counters and gauges with labels, cumulative histograms. Not thread-safe: each
service updates them from its event loop only.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

LabelKey = tuple[tuple[str, str], ...]


def _labels(key: LabelKey, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = key + extra
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in items) + "}"


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self._values: dict[LabelKey, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{_labels(k)} {v:g}" for k, v in sorted(self._values.items())]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self._values[tuple(sorted(labels.items()))] = value

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.inc(-amount, **labels)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # last: +Inf
        self._sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self._sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines, cumulative = self.header(), 0
        for bound, n in zip((*self.buckets, float("inf")), self._counts):
            cumulative += n
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            lines.append(f'{self.name}_bucket{{le="{le}"}} {cumulative}')
        return lines + [f"{self.name}_sum {self._sum:g}", f"{self.name}_count {self.count}"]


class Registry:
    def __init__(self) -> None:
        self._metrics: list[_Metric] = []

    def add(self, metric: _Metric):
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self._metrics for line in m.render()) + "\n"


LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RecentMean:
    """Mean of the observations of the last ``window_s`` seconds (None when there are none)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque()

    def observe(self, value: float, now: float | None = None) -> None:
        self._items.append((time.monotonic() if now is None else now, value))

    def mean(self, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        while self._items and self._items[0][0] < now - self.window_s:
            self._items.popleft()
        return sum(v for _, v in self._items) / len(self._items) if self._items else None
