"""The chaos drill's pure bookkeeping: outcomes classified against the greedy reference, the per-fault
report's counts, recovery time and leak figures, the totals, and the table and plot."""

from __future__ import annotations

import json

import pytest

from loadtest.chaos.drill import ChaosConfig, parse_args, prompts
from loadtest.chaos.report import (RequestOutcome, classify, difference, fault_report, format_table,
                                   format_totals, plot, report_from_json,
                                   skipped_report, totals)

REFERENCE = {0: "one two three", 1: "alpha beta"}


def ok(i: int, sent: float, ended: float, prompt: int = 0) -> RequestOutcome:
    return RequestOutcome(i, prompt, sent, ended, text=REFERENCE[prompt])


def test_difference_names_lost_repeated_and_changed_tokens():
    assert difference("one two three", "one two three") is None
    assert difference("one three", "one two three") == "lost"
    assert difference("one two two three", "one two three") == "repeated"
    assert difference("one tw0 three", "one two three") == "changed"


def test_classify_puts_hung_before_failed_before_differing():
    assert classify(RequestOutcome(0, 0, 1.0, None, error="HTTP 503"), REFERENCE) == "hung"
    assert classify(RequestOutcome(0, 0, 1.0, 2.0, error="HTTP 503", text="one two three"), REFERENCE) == "failed"
    assert classify(RequestOutcome(0, 1, 1.0, 2.0, text="alpha"), REFERENCE) == "differing"
    assert classify(ok(0, 1.0, 2.0, prompt=1), REFERENCE) == "ok"


def test_fault_report_counts_each_kind_and_keeps_failures_by_status():
    outcomes = [ok(0, 0.0, 1.0), ok(1, 0.5, 1.5, prompt=1),
                RequestOutcome(2, 0, 1.0, 2.5, error="HTTP 503"), RequestOutcome(3, 1, 1.2, 2.6, error="HTTP 503"),
                RequestOutcome(4, 0, 1.3, 2.7, error="stream cut", text="one"),
                RequestOutcome(5, 0, 1.4, None),
                RequestOutcome(6, 1, 1.5, 3.0, text="alpha beta beta"),
                RequestOutcome(7, 0, 1.6, 3.1, text="one")]
    r = fault_report("kill-decode", outcomes, REFERENCE, fault_at_s=1.1, leaked_blocks={"w1": 3, "w2": 0},
                     restarts={"decode-1": 1, "gateway": 0}, notes=["SIGKILL decode-1"])
    assert (r.num_sent, r.num_succeeded, r.num_failed, r.num_hung, r.num_differing) == (8, 4, 3, 1, 2)
    assert r.failed_by_kind == {"HTTP 503": 2, "stream cut": 1}
    assert r.differing_by_kind == {"repeated": 1, "lost": 1}
    assert r.leaked_blocks == {"w1": 3} and r.num_leaked_blocks == 3
    assert r.restarts == {"decode-1": 1}
    assert not r.is_clean
    # the first success among requests sent at or after 1.1 s ends at 3.0 s (request 6; 2 and 4 failed)
    assert r.recovery_s == 1.9
    assert r.next_success_s == 0.4  # request 1, sent before the fault
    assert r.e2e_p50_s == 1.25  # of 1.0, 1.0, 1.5 and 1.5 s (the succeeded ones)


def test_serving_is_the_first_token_of_a_success_sent_after_the_fault():
    def streamed(i: int, sent: float, first: float | None, ended: float | None, error: str | None = None):
        return RequestOutcome(i, 0, sent, ended, error=error, text="" if error else REFERENCE[0],
                              first_token_s=first)

    outcomes = [streamed(0, 0.0, 0.5, 4.0),                      # sent before the fault
                streamed(1, 2.0, 2.4, 3.0, error="stream cut"),  # failed: not serving
                streamed(2, 2.1, 2.6, None),                     # hung
                streamed(3, 2.2, 2.9, 6.0), streamed(4, 2.3, 2.8, 7.0)]
    r = fault_report("kill-gateway", outcomes, REFERENCE, fault_at_s=2.0)
    assert r.serving_s == 0.8      # request 4's first token at 2.8 s
    assert r.recovery_s == 4.0     # request 3 ends first, at 6.0 s
    assert "serve s" in format_table([r]) and " 0.80 " in format_table([r])
    assert fault_report("x", outcomes[:1], REFERENCE, fault_at_s=2.0).serving_s is None


def test_a_clean_fault_and_no_success_after_it():
    r = fault_report("kill-kv-index", [ok(0, 0.0, 1.0), ok(1, 0.2, 4.0)], REFERENCE, fault_at_s=2.0)
    assert r.is_clean and r.num_leaked_blocks == 0
    assert r.recovery_s is None  # nothing was sent after the fault
    assert r.next_success_s == 2.0
    assert fault_report("none", [ok(0, 0.0, 1.0)], REFERENCE, fault_at_s=None).recovery_s is None


def test_totals_leave_skipped_faults_out_and_the_table_says_why_they_were_skipped(tmp_path):
    clean = fault_report("kill-admission", [ok(0, 0.0, 1.0), ok(1, 0.0, 2.0)], REFERENCE, fault_at_s=0.5)
    bad = fault_report("restart-nats", [ok(0, 0.0, 1.0), RequestOutcome(1, 0, 0.0, 9.0, error="HTTP 504")],
                       REFERENCE, fault_at_s=0.5)
    skipped = skipped_report("kill-gateway", "needs --gateways 2")
    t = totals([clean, bad, skipped])
    assert t == {"num_faults": 2, "num_skipped": 1, "num_clean": 1, "num_sent": 4, "num_succeeded": 3,
                 "num_failed": 1, "num_hung": 0, "num_differing": 0, "num_leaked_blocks": 0, "success_ratio": 0.75}
    assert "1/2 faults clean (1 skipped); 3/4 requests succeeded (75.00%)" in format_totals(t)
    table = format_table([clean, bad, skipped])
    assert "kill-gateway     skipped: needs --gateways 2" in table
    assert "HTTP 504: 1" in table.splitlines()[2]
    assert json.loads(json.dumps(bad.to_json()))["is_clean"] is False
    assert [report_from_json(json.loads(json.dumps(r.to_json()))) for r in (clean, bad, skipped)] == [
        clean, bad, skipped]
    assert plot([clean, bad, skipped], tmp_path / "chaos.png").stat().st_size > 0


def test_cli_parses_sizes_and_faults_and_rejects_unknown_faults(capsys):
    cfg, _ = parse_args(["--decode", "3", "--prefill", "0", "--concurrency", "4", "--faults",
                         "kill-decode, stop-decode", "--stop-s", "2"])
    assert (cfg.num_decode, cfg.num_prefill, cfg.concurrency) == (3, 0, 4)
    assert cfg.faults == ("kill-decode", "stop-decode") and cfg.fault_options.stop_s == 2.0
    assert ChaosConfig().faults[0] == "none"
    with pytest.raises(SystemExit) as exc:
        parse_args(["--faults", "kill-everything"])
    assert exc.value.code == 2
    assert "unknown fault(s) kill-everything" in capsys.readouterr().err


def test_prompts_are_fixed_and_distinct():
    assert prompts(20) == prompts(20) and len(set(prompts(20))) == 20
