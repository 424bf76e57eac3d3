import argparse
import random

from loadtest.tools.stats import RequestResult, summarize
from loadtest.tools.workload import WorkloadConfig, arrival_times, build_workload
from shared.telemetry.measure import percentile


def test_gamma_arrivals_keep_the_mean_rate_and_burstiness_widens_gaps():
    rng = random.Random(1)
    poisson = arrival_times(4000, rate=10, burstiness=1.0, rng=rng)
    bursty = arrival_times(4000, rate=10, burstiness=0.25, rng=rng)
    assert abs(poisson[-1] / 4000 - 0.1) < 0.01 and abs(bursty[-1] / 4000 - 0.1) < 0.02

    def cv(times):
        gaps = [b - a for a, b in zip(times, times[1:])]
        mean = sum(gaps) / len(gaps)
        return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

    assert 0.9 < cv(poisson) < 1.1 and cv(bursty) > 1.7


def test_workload_is_seeded_and_shares_prefixes():
    cfg = WorkloadConfig(num_requests=20, shared_prefix_words=30, num_prefixes=2, seed=3)
    a, b = build_workload(cfg), build_workload(cfg)
    assert a == b
    assert len({" ".join(s.prompt.split()[:30]) for s in a}) == 2
    assert all(s.max_tokens >= 1 for s in a)


def test_summary():
    results = [RequestResult(i, 0.0, float(i), first_token_s=i + 0.1, finished_s=i + 1.1,
                             token_times_s=[i + 0.1, i + 0.6, i + 1.1], num_output_tokens=3)
               for i in range(4)]
    results.append(RequestResult(4, 0.0, 4.0, error="HTTP 429"))
    s = summarize(results, slo_ttft_s=0.2, slo_tpot_s=0.4)
    assert (s["num_ok"], s["num_errors"], s["errors"]) == (4, 1, ["HTTP 429"])
    assert abs(s["ttft_s"]["p50"] - 0.1) < 1e-9 and abs(s["itl_s"]["p99"] - 0.5) < 1e-9
    assert s["num_good"] == 0  # tpot 0.5 > 0.4
    assert abs(s["output_token_throughput"] - 12 / 4.1) < 1e-9
    assert percentile([1, 2, 3, 4], 50) == 2.5


def test_overload_report_compares_each_admitted_ttft_with_its_prediction():
    from loadtest.bench.overload import tier_report

    def done(i, ttft, predicted):
        return RequestResult(i, 0.0, 0.0, first_token_s=ttft, finished_s=ttft + 1, num_output_tokens=2,
                             predicted_ttft_s=predicted)

    results = [done(0, 1.0, 0.5), done(1, 3.0, 1.0), done(2, 2.0, None),  # batch: 2x and 3x
               done(3, 0.2, 0.2),                                          # premium: as predicted
               RequestResult(4, 0.0, 0.0, error="HTTP 429", retry_after_s=2.0)]
    tiers = {0: "batch", 1: "batch", 2: "batch", 3: "premium", 4: "batch"}
    report = tier_report(results, tiers, {"premium": 1.0, "batch": 2.5})
    assert report["batch"]["ttft_over_predicted_p50"] == 2.5 and report["batch"]["num_429"] == 1
    assert report["batch"]["num_good"] == 2 and report["premium"]["ttft_over_predicted_p90"] == 1.0
    rows = report["per_request"]  # every request, for the calibration by time of arrival
    assert len(rows) == 5 and rows[1] == {"tier": "batch", "sent_s": 0.0, "predicted_ttft_s": 1.0,
                                          "ttft_s": 3.0, "error": None}
    assert rows[4]["error"] == "HTTP 429" and rows[4]["ttft_s"] is None


def test_bench_startup_summary_counts_sheds_and_misses_per_tier():
    from loadtest.bench.startup import burst, summarize
    from loadtest.tools.stats import RequestResult

    args = argparse.Namespace(batch_requests=3, premium_requests=1, batch_words=4, premium_words=2,
                              premium_after_s=1.0, output_tokens=2)
    specs, tier_of = burst(args)
    assert [tier_of[s.index] for s in specs] == ["batch"] * 3 + ["premium"] and specs[-1].at_s == 1.0
    served = RequestResult(0, 0.0, 0.0, first_token_s=5.0, predicted_ttft_s=2.5)
    shed = RequestResult(1, 0.0, 0.0, error="HTTP 429", retry_after_s=2.0)
    shed_bare = RequestResult(2, 0.0, 0.0, error="HTTP 429")
    fast = RequestResult(3, 1.0, 1.0, first_token_s=1.5)
    out = summarize([served, shed, shed_bare, fast], tier_of, slo_s=4.0)
    assert (out["batch"]["admitted"], out["batch"]["rejected"], out["batch"]["rejected_with_retry_after"]) == (1, 2, 1)
    assert out["batch"]["attainment"] == 0.0 and out["batch"]["predicted_over_measured_p50"] == 0.5
    assert out["premium"]["attainment"] == 1.0 and out["premium"]["ttft_p90_s"] == 0.5
