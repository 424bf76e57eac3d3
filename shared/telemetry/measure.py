"""The measurement rules every report uses: percentiles, a latency distribution, and which
requests count as good (goodput, SLO attainment).

One definition each, shared by the live dashboard (``series.py``), the load generator's and the
replay's summaries (``loadtest/``) and the simulator's report (``shared/sim/report.py``), so a
simulated and a measured p90 or goodput mean the same thing.

* Percentiles are numpy's default (linear interpolation between the closest ranks, ``q`` in
  [0, 100]). Missing values (None, NaN) are dropped first; with nothing left the result is
  ``empty`` (None unless the caller asks for NaN).
* A request is good when it was served, its TTFT is known and within the TTFT SLO, and, where
  there is a TPOT SLO, its TPOT is within it. A missing TTFT is never good; a missing TPOT (a
  one-token output has no inter-token time) passes the TPOT SLO. Goodput is good requests per
  second of the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

DISTRIBUTION_QUANTILES = (50, 90, 99)


def present(values: Iterable[float | None] | np.ndarray) -> np.ndarray:
    """``values`` as a float64 array without its missing entries (None, NaN)."""
    if isinstance(values, np.ndarray):
        xs = values.astype(np.float64, copy=False).ravel()
    else:
        xs = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    return xs[~np.isnan(xs)]


def percentile(values: Iterable[float | None] | np.ndarray, q: float,
               empty: float | None = None) -> float | None:
    """The ``q``-th percentile (``q`` in [0, 100]) of ``values``' present entries; ``empty`` when none."""
    xs = present(values)
    return float(np.percentile(xs, q)) if xs.size else empty


def percentiles(values: Iterable[float | None] | np.ndarray, qs: Sequence[float] = DISTRIBUTION_QUANTILES,
                empty: float | None = None) -> dict[str, float | None]:
    """``{"p50": ..., "p90": ...}`` for each of ``qs``, as :func:`percentile`."""
    xs = present(values)
    if not xs.size:
        return {f"p{q:g}": empty for q in qs}
    return {f"p{q:g}": float(v) for q, v in zip(qs, np.percentile(xs, list(qs)))}


def distribution(values: Iterable[float | None] | np.ndarray) -> dict[str, float | None]:
    """Mean and p50/p90/p99 of the present entries (None each when there are none)."""
    xs = present(values)
    return {"mean": float(xs.mean()) if xs.size else None, **percentiles(xs)}


def meets_slo(ttft_s: float | None, tpot_s: float | None, ttft_slo_s: float,
              tpot_slo_s: float | None = None) -> bool:
    """Whether a served request is good: TTFT known and within ``ttft_slo_s``; TPOT (where
    ``tpot_slo_s`` is given and the request has one) within ``tpot_slo_s``."""
    if ttft_s is None or np.isnan(ttft_s) or ttft_s > ttft_slo_s:
        return False
    return tpot_slo_s is None or tpot_s is None or np.isnan(tpot_s) or tpot_s <= tpot_slo_s


def meets_slo_array(ttft_s: np.ndarray, tpot_s: np.ndarray | None, ttft_slo_s: float,
                    tpot_slo_s: float | None = None) -> np.ndarray:
    """:func:`meets_slo` over arrays (NaN for missing), elementwise; AND it with "served"."""
    good = np.nan_to_num(ttft_s, nan=np.inf) <= ttft_slo_s
    if tpot_slo_s is not None and tpot_s is not None:
        good &= np.nan_to_num(tpot_s, nan=0.0) <= tpot_slo_s
    return good
