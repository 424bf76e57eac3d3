"""The one set of measurement rules (shared.telemetry.measure): numpy percentiles and the goodput rule."""

import math

import numpy as np
import pytest

from shared.telemetry.measure import distribution, meets_slo, meets_slo_array, percentile, percentiles


def test_percentiles_are_numpys_linear_ones_over_the_present_values():
    xs = [0.3, 0.1, None, 0.4, math.nan, 0.2]
    assert percentiles(xs) == pytest.approx({f"p{q}": np.percentile([0.1, 0.2, 0.3, 0.4], q) for q in (50, 90, 99)})
    assert percentile(np.array([1.0, np.nan, 3.0]), 50) == 2.0
    assert percentiles([], (50, 90)) == {"p50": None, "p90": None}
    assert math.isnan(percentiles([None], (50,), empty=math.nan)["p50"])
    assert percentiles([1.0, 2.0], (99.9,)).keys() == {"p99.9"}


def test_distribution_has_the_mean_and_three_percentiles():
    assert distribution([1.0, 2.0, 3.0]) == pytest.approx({"mean": 2.0, "p50": 2.0, "p90": 2.8, "p99": 2.98})
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_a_missing_ttft_is_never_good_and_a_missing_tpot_passes():
    assert meets_slo(0.5, 0.05, 1.0, 0.1)
    assert not meets_slo(None, 0.05, 1.0, 0.1)
    assert not meets_slo(math.nan, None, 1.0)
    assert not meets_slo(1.5, 0.05, 1.0, 0.1)
    assert not meets_slo(0.5, 0.2, 1.0, 0.1)
    assert meets_slo(0.5, None, 1.0, 0.1)       # one token: no inter-token time
    assert meets_slo(0.5, 0.2, 1.0)             # no TPOT SLO


def test_the_array_rule_is_the_scalar_rule():
    ttft = np.array([0.5, np.nan, 1.5, 0.5, 0.5])
    tpot = np.array([0.05, 0.05, 0.05, 0.2, np.nan])
    scalar = [meets_slo(None if np.isnan(a) else a, None if np.isnan(b) else b, 1.0, 0.1) for a, b in zip(ttft, tpot)]
    assert meets_slo_array(ttft, tpot, 1.0, 0.1).tolist() == scalar == [True, False, False, False, True]
    assert meets_slo_array(ttft, None, 1.0).tolist() == [True, False, False, True, True]


def test_the_figure_helper_saves_and_closes(tmp_path):
    import matplotlib.pyplot as plt

    from shared.telemetry.plot import cdf, figure

    with figure(tmp_path / "a.png", 1, 2, figsize=(4, 2)) as (fig, (left, right)):
        cdf(left, [3.0, 1.0, 2.0], "x")
        cdf(right, [], "nothing")
    assert (tmp_path / "a.png").stat().st_size > 0 and not plt.get_fignums()
    with pytest.raises(RuntimeError), figure(tmp_path / "b.png", figsize=(4, 2)):
        raise RuntimeError("a broken plot")
    assert not (tmp_path / "b.png").exists() and not plt.get_fignums()
