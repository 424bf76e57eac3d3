"""``loadtest.tools.split_oracle``: the hindsight estimate of what switching splits per window could gain."""

import json

from loadtest.tools import split_oracle

TIERS = {"premium": {"slo_ttft_s": 1.0, "slo_tpot_s": 0.1}, "batch": {"slo_ttft_s": 10.0, "slo_tpot_s": None}}


def summary(requests):
    """(arrival s, tier, ttft s, tpot s) per request; None ttft: rejected."""
    return {"tiers": TIERS, "per_request": [
        {"scheduled_s": at, "tier": tier, "status": "rejected" if ttft is None else "ok", "ttft_s": ttft,
         "tpot_s": tpot} for at, tier, ttft, tpot in requests]}


def test_each_window_takes_the_split_that_served_it_best(tmp_path):
    # split A serves the first minute well and the second badly, B the other way round
    a = summary([(10, "premium", 0.5, 0.05), (20, "premium", 0.5, 0.05), (30, "batch", 5.0, 1.0),
                 (70, "premium", 2.0, 0.05), (80, "premium", None, None), (90, "premium", 0.5, 0.2)])
    b = summary([(10, "premium", 2.0, 0.05), (20, "premium", 0.5, 0.05), (30, "batch", 12.0, 0.0),
                 (70, "premium", 0.5, 0.05), (80, "premium", 0.9, 0.1), (90, "premium", 0.5, 0.05)])
    policy = summary([(10, "premium", 0.5, 0.05), (20, "premium", 0.5, 0.05), (30, "batch", 5.0, 0.0),
                      (70, "premium", 0.5, 0.05), (80, "premium", 3.0, 0.05), (90, "premium", 0.5, 0.05)])
    assert split_oracle.good_by_window(a, 60) == {0: 3}
    assert split_oracle.good_by_window(b, 60) == {0: 1, 1: 3}
    r = split_oracle.oracle({"a": a, "b": b}, {"auto": policy}, 60)
    assert r["good_requests"] == {"a": 3, "b": 4} and r["best_fixed"] == "b"
    assert (r["hindsight_good_requests"], r["splits_picked"]) == (6, {"a": 1, "b": 1})
    assert r["hindsight_over_best_fixed"] == 1.5 and r["policies"]["auto"]["over_best_fixed"] == 1.25
    one = split_oracle.oracle({"a": a, "b": b}, {}, 120)   # one window: the best fixed split itself
    assert (one["hindsight_good_requests"], one["splits_picked"]) == (4, {"b": 1})
    paths = []
    for name, s in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(s))
        paths.append(str(tmp_path / f"{name}.json"))
    out = tmp_path / "oracle.json"
    assert split_oracle.main(["--fixed", *paths, "--window-s", "60", "--out", str(out)]) == 0
    assert json.loads(out.read_text())[0]["hindsight_good_requests"] == 6


def test_a_summary_without_per_request_results_or_a_bad_window_is_refused(tmp_path, capsys):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"tiers": TIERS}))
    assert split_oracle.main(["--fixed", str(bare)]) == 2
    assert "no per-request results" in capsys.readouterr().err
    assert split_oracle.main(["--fixed", str(bare), "--window-s", "0"]) == 2
    assert "--window-s must be positive" in capsys.readouterr().err
