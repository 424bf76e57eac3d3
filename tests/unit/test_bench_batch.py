"""The Batch-API benchmark's pure parts: each segment's own prompts and the pooled report over rounds
(the run itself needs a real stack: ``python -m loadtest.bench.batch``)."""

from __future__ import annotations

import pytest

from loadtest.bench.batch import Round, pooled, tagged
from loadtest.tools.stats import RequestResult
from loadtest.tools.workload import WorkloadConfig, build_workload


def test_each_segment_gets_prompts_of_its_own_on_the_same_schedule():
    specs = build_workload(WorkloadConfig(num_requests=6, rate=2.0, seed=3))
    alone, beside = tagged(specs, "Alone 0:"), tagged(specs, "Beside 0:")
    assert [(s.at_s, s.max_tokens) for s in alone] == [(s.at_s, s.max_tokens) for s in specs]
    assert [(s.at_s, s.max_tokens) for s in beside] == [(s.at_s, s.max_tokens) for s in specs]
    # no prompt of one segment is a prefix of the other's: the second cannot hit the first's cached blocks
    assert not any(b.prompt.startswith(a.prompt[:10]) for a in alone for b in beside)
    assert all(a.prompt.endswith(s.prompt) for a, s in zip(alone, specs))


def result(index: int, ttft: float, itl: float, tokens: int = 3) -> RequestResult:
    r = RequestResult(index=index, scheduled_s=0.0, started_s=10.0, num_output_tokens=tokens,
                      first_token_s=10.0 + ttft, prompt_tokens=100, cached_tokens=0)
    r.token_times_s = [r.first_token_s + itl * k for k in range(tokens)]
    r.finished_s = r.token_times_s[-1]
    return r


def a_round(alone_ttfts, beside_ttfts, lines: int, window_s: float, steal: float | None = 0.3) -> Round:
    return Round(alone=[result(i, t, 0.02) for i, t in enumerate(alone_ttfts)],
                 beside=[result(i, t, 0.03) for i, t in enumerate(beside_ttfts)],
                 progress=None, window=(0.0, 10.0), lines=lines, window_s=window_s,
                 summary={"cpu_steal_share": {"alone": steal, "beside": 0.1}})


def test_the_pooled_report_puts_every_rounds_requests_together_and_the_batch_over_every_window():
    rounds = [a_round([0.1, 0.2], [0.2, 0.4], lines=10, window_s=10.0),
              a_round([0.3, 0.4], [0.6, 0.8], lines=30, window_s=10.0, steal=0.1)]
    report = pooled(rounds, capacity=4.0)
    assert report["online_alone"]["num_ok"] == 4 and report["online_beside_batch"]["num_ok"] == 4
    assert report["online_alone"]["rate_rps"] == pytest.approx(4 / 20.0)   # over both rounds' arrival spans
    bb = report["batch_beside_online"]
    assert bb["rate_rps"] == pytest.approx(40 / 20.0)                      # not the mean of 1.0 and 3.0 per round
    assert bb["idle_capacity_rps"] == pytest.approx(4.0 - 0.2)
    assert bb["fraction_of_idle_capacity"] == pytest.approx(2.0 / 3.8)
    # beside is twice alone in every round, so the pooled ratios are 2 whatever the percentile's interpolation
    assert report["online_ttft_p50_ratio"] == pytest.approx(2.0)
    assert report["online_ttft_p90_ratio"] == pytest.approx(2.0)
    assert report["online_itl_p50_ratio"] == pytest.approx(1.5)
    assert report["online_alone"]["cached_prompt_share"] == 0.0
    assert report["cpu_steal_share"] == {"alone": pytest.approx(0.2), "beside": pytest.approx(0.1)}
    assert "fraction_of_idle_sustained" not in bb
    # the batch alone ran at 5 lines/s, above the bursts' 4 req/s: the share against that rate too
    sustained = pooled(rounds, capacity=4.0, batch_alone_rps=5.0)["batch_beside_online"]
    assert sustained["fraction_of_idle_sustained"] == pytest.approx(2.0 / 4.8)
    assert sustained["fraction_of_idle_capacity"] == bb["fraction_of_idle_capacity"]
