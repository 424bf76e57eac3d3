"""The workload-shift benchmark's pure parts: the phased schedule, the SLO rule and the per-phase
report (the run itself needs three real stacks: ``python -m loadtest.bench.shift``)."""

from __future__ import annotations

import pytest

from loadtest.bench.shift import meets_slo, parse_args, phase_report, schedule
from loadtest.tools.stats import RequestResult


def test_the_schedule_runs_the_phases_back_to_back_with_their_own_shapes():
    args = parse_args(["--phase-s", "20", "--chat-rate", "1", "--docs-rate", "0.5"])
    specs, phase_of = schedule(args)
    by_phase = {p: [s for s in specs if phase_of[s.index] == p] for p in ("chat", "docs", "chat again")}
    assert [len(v) for v in by_phase.values()] == [20, 10, 20]
    assert [s.index for s in specs] == list(range(len(specs)))
    for k, (phase, part) in enumerate(by_phase.items()):
        assert all(20 * k <= s.at_s for s in part), phase        # each phase starts at its offset
    assert max(len(s.prompt.split()) for s in by_phase["chat"]) < min(len(s.prompt.split()) for s in by_phase["docs"])
    assert min(s.max_tokens for s in by_phase["chat"]) > max(s.max_tokens for s in by_phase["docs"])


def result(index: int, ttft: float | None, itl: float, tokens: int = 5, error: str | None = None) -> RequestResult:
    r = RequestResult(index=index, scheduled_s=0.0, started_s=1.0, num_output_tokens=tokens, error=error)
    if ttft is not None:
        r.first_token_s = 1.0 + ttft
        r.finished_s = r.first_token_s + itl * (tokens - 1)
    return r


def test_a_request_meets_its_slo_only_within_both_budgets():
    assert meets_slo(result(0, 0.5, 0.05), 1.0, 0.1)
    assert not meets_slo(result(0, 1.5, 0.05), 1.0, 0.1)    # first token late
    assert not meets_slo(result(0, 0.5, 0.2), 1.0, 0.1)     # tokens too slow after it
    assert not meets_slo(result(0, 0.5, 0.05, error="HTTP 503"), 1.0, 0.1)
    assert not meets_slo(result(0, None, 0.0), 1.0, 0.1)     # never answered
    assert meets_slo(result(0, 0.5, 0.0, tokens=1), 1.0, 0.1)  # one token: no inter-token gap


def test_the_report_counts_failures_as_misses_per_phase():
    results = [result(0, 0.5, 0.05), result(1, 2.0, 0.05), result(2, 0.5, 0.05), result(3, None, 0.0, error="HTTP 429")]
    phases = {0: "chat", 1: "chat", 2: "docs", 3: "docs"}
    report = phase_report(results, phases, 1.0, 0.1)
    assert report["chat"]["slo_attainment"] == 0.5 and report["docs"]["slo_attainment"] == 0.5
    assert report["docs"]["num_errors"] == 1 and report["docs"]["num_ok"] == 1
    assert report["all"] == {"num_sent": 4, "slo_attainment": 0.5}


def test_unknown_setups_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--setups", "fixed 3D"])
    assert "unknown setup" in capsys.readouterr().err
