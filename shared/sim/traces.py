"""Request traces: Poisson and gamma-bursty arrivals, and Mooncake-style JSONL.

A Mooncake trace line is ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}``; each hash id names one block of ``block_size`` prompt tokens, and equal
leading ids mean a shared prefix. Synthetic traces have no hash ids (no prefix sharing) unless
made with :func:`synthetic_mooncake`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.planner.config import WorkloadSpec

MOONCAKE_BLOCK_SIZE = 512


@dataclass
class Trace:
    arrival_s: np.ndarray          # [N] float64, sorted
    input_len: np.ndarray          # [N] int64
    output_len: np.ndarray         # [N] int64
    hash_ids: list[list[int]] | None = None   # per request, or None (no prefix sharing)
    block_size: int = MOONCAKE_BLOCK_SIZE
    tiers: list[str] | None = None   # per request, or None (drawn by the simulator from its tier mix)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.input_len) != n or len(self.output_len) != n:
            raise ValueError(f"trace arrays differ in length: {n}, {len(self.input_len)}, {len(self.output_len)}")
        if self.hash_ids is not None and len(self.hash_ids) != n:
            raise ValueError(f"hash_ids has {len(self.hash_ids)} entries for {n} requests")
        if self.tiers is not None and len(self.tiers) != n:
            raise ValueError(f"tiers has {len(self.tiers)} entries for {n} requests")
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("arrival times must be sorted")


def sample_lengths(workload: WorkloadSpec, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Lengths by class (fixed per class) or lognormal around the means with ``length_cv``."""
    if workload.classes:
        mix = workload.class_mix()
        k = rng.choice(len(mix), size=n, p=[c.fraction for c in mix])
        return (np.array([c.input_len for c in mix])[k], np.array([c.output_len for c in mix])[k])

    def lognormal(mean: float) -> np.ndarray:
        if workload.length_cv == 0:
            return np.full(n, int(mean))
        sigma2 = np.log1p(workload.length_cv**2)
        x = rng.lognormal(np.log(mean) - sigma2 / 2, np.sqrt(sigma2), size=n)
        return np.maximum(np.rint(x), 1).astype(np.int64)
    return lognormal(workload.input_len), lognormal(workload.output_len)


def poisson(workload: WorkloadSpec, n: int, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / workload.request_rate, size=n))
    return Trace(arrivals, *sample_lengths(workload, n, rng))


def gamma(workload: WorkloadSpec, n: int, cv: float = 3.0, seed: int = 0) -> Trace:
    """Bursty arrivals: gamma inter-arrival times with mean 1/rate and coefficient of variation ``cv``."""
    if cv <= 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    rng = np.random.default_rng(seed)
    shape = 1.0 / cv**2
    arrivals = np.cumsum(rng.gamma(shape, 1.0 / (workload.request_rate * shape), size=n))
    return Trace(arrivals, *sample_lengths(workload, n, rng))


@dataclass(frozen=True)
class TraceRecord:
    """One line of a Mooncake trace: its arrival (seconds, as written), prompt and output tokens,
    and the ids of its prompt blocks (empty when the line has none)."""

    at_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]


def read_mooncake(path: str | Path) -> Iterator[TraceRecord]:
    """The trace's records in file order, read lazily; blank lines skipped. A line that is not a
    record, or whose prompt is empty, raises ValueError naming the file and line."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                record = TraceRecord(float(rec["timestamp"]) / 1000.0, int(rec["input_length"]),
                                     int(rec["output_length"]), tuple(int(h) for h in rec.get("hash_ids") or ()))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc!r})") from exc
            if record.input_len < 1:
                raise ValueError(f"{path}:{lineno}: input_length must be >= 1")
            yield record


def load_mooncake(path: str | Path, block_size: int = MOONCAKE_BLOCK_SIZE, limit: int | None = None) -> Trace:
    """The first ``limit`` records of the file (all by default) as a trace, sorted by arrival
    (stable) and counted from the earliest."""
    recs = sorted(itertools.islice(read_mooncake(path), limit), key=lambda r: r.at_s)
    t0 = recs[0].at_s if recs else 0.0
    return Trace(np.array([r.at_s - t0 for r in recs], dtype=np.float64),
                 np.array([r.input_len for r in recs], dtype=np.int64),
                 np.array([r.output_len for r in recs], dtype=np.int64),
                 [list(r.hash_ids) for r in recs], block_size)


def write_mooncake(trace: Trace, path: str | Path) -> None:
    with open(path, "w") as f:
        for i in range(len(trace)):
            ids = trace.hash_ids[i] if trace.hash_ids is not None else []
            f.write(json.dumps({"timestamp": int(round(trace.arrival_s[i] * 1000)),
                                "input_length": int(trace.input_len[i]),
                                "output_length": int(trace.output_len[i]), "hash_ids": ids}) + "\n")


def synthetic_mooncake(workload: WorkloadSpec, n: int, num_prefixes: int = 50, shared_fraction: float = 0.5,
                       block_size: int = MOONCAKE_BLOCK_SIZE, seed: int = 0) -> Trace:
    """Poisson arrivals where each prompt starts with one of ``num_prefixes`` shared prefixes
    (Zipf-popular) covering about ``shared_fraction`` of its blocks; the rest are unique."""
    base = poisson(workload, n, seed)
    rng = np.random.default_rng(seed + 1)
    popularity = 1.0 / np.arange(1, num_prefixes + 1)
    prefix_of = rng.choice(num_prefixes, size=n, p=popularity / popularity.sum())
    next_id = num_prefixes * 10_000
    hashes = []
    for i in range(n):
        blocks = -(-int(base.input_len[i]) // block_size)
        shared = int(blocks * shared_fraction)
        ids = [int(prefix_of[i]) * 10_000 + k for k in range(shared)]
        ids += list(range(next_id, next_id + blocks - shared))
        next_id += blocks - shared
        hashes.append(ids)
    return Trace(base.arrival_s, base.input_len, base.output_len, hashes, block_size)
