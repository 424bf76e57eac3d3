"""`tandem plan` / `tandem simulate` through their own parsers (no other command modules loaded)."""

import argparse
import json
from pathlib import Path

import pytest

from services.commands import plan_cmds
from services.framework.errors import CliError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "clusters"


def run(*argv):
    parser = argparse.ArgumentParser(prog="tandem")
    plan_cmds.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args([str(a) for a in argv])
    return args.func(args)


def test_plan_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert run("plan", EXAMPLES / "small-8gpu.yaml", "--model", "llama-2-7b", "--workload",
               EXAMPLES / "workload-mixed.yaml", "--json", out) == 0
    assert "capacity" in capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert {w["role"] for w in plan["workers"]} >= {"prefill", "decode"}
    assert all(w["tp"] * w["pp"] == len(w["gpus"]) for w in plan["workers"])


def test_plan_reads_model_and_workload_from_env(monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_PLAN_MODEL", "opt-30b")
    monkeypatch.setenv("TANDEM_PLAN_WORKLOAD", "spld")
    assert run("plan", EXAMPLES / "small-8gpu.yaml", "--format", "json") == 0
    assert json.loads(capsys.readouterr().out)["model"] == "opt-30b"


@pytest.mark.parametrize("argv,message", [
    (["plan", EXAMPLES / "nope.yaml", "--model", "opt-30b"], "cannot read"),
    (["plan", EXAMPLES / "small-8gpu.yaml", "--model", "gpt-9"], "neither a preset"),
    (["plan", EXAMPLES / "small-8gpu.yaml", "--model", "opt-30b", "--hbm-eff", "1.5"], "--hbm-eff"),
    (["simulate", EXAMPLES / "small-8gpu.yaml", "--model", "opt-30b", "--trace", "nope.jsonl"], "--trace"),
])
def test_user_errors_are_cli_errors(argv, message, monkeypatch):
    monkeypatch.delenv("TANDEM_PLAN_MODEL", raising=False)
    with pytest.raises(CliError, match=message):
        run(*argv)


def test_simulate_writes_summary_and_png(tmp_path, capsys):
    assert run("simulate", EXAMPLES / "small-8gpu.yaml", "--model", "llama-2-7b", "--workload",
               EXAMPLES / "workload-chat.yaml", "--rate", "5", "--trace", "gamma", "--num-requests", "500",
               "--out", tmp_path) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_requests"] == 500 and 0 <= summary["slo_attainment"] <= 1
    assert (tmp_path / "utilisation.png").stat().st_size > 1000
    assert "goodput" in capsys.readouterr().out


def test_calibration_file_sets_the_efficiencies(capsys, tmp_path):
    assert run("plan", EXAMPLES / "small-8gpu.yaml", "--model", "llama-2-7b",
               "--calibration", EXAMPLES / "calibration-example.yaml") == 0
    assert "calibrated: compute efficiency 0.4" in capsys.readouterr().out
    bad = tmp_path / "cal.yaml"
    bad.write_text("model: llama-2-7b\ngpu: {tflops_bf16: 1, hbm_gib: 1, hbm_gbps: 1, price_per_hour: 0}\n"
                   "prefill: [{num_tokens: 0, seconds: 1}]\n")
    with pytest.raises(CliError, match=r"prefill.0.num_tokens"):
        run("plan", EXAMPLES / "small-8gpu.yaml", "--model", "llama-2-7b", "--calibration", bad)


def test_simulate_replays_a_mooncake_trace(capsys):
    assert run("simulate", EXAMPLES / "small-8gpu.yaml", "--model", "llama-2-7b", "--workload",
               EXAMPLES / "workload-chat.yaml", "--trace", EXAMPLES / "mooncake-format-synthetic.jsonl") == 0
    out = capsys.readouterr().out
    assert "requests 1,000" in out and "prefix-hit tokens 0," not in out


def test_simulate_with_a_tier_mix(capsys):
    assert run("simulate", EXAMPLES / "small-8gpu.yaml", "--model", "llama-2-7b", "--workload",
               EXAMPLES / "workload-chat.yaml", "--rate", "30", "--num-requests", "2000",
               "--tiers", "premium=0.3,batch=0.7") == 0
    out = capsys.readouterr().out
    assert "premium:" in out and "batch:" in out
    with pytest.raises(CliError, match="--tiers"):
        run("simulate", EXAMPLES / "small-8gpu.yaml", "--model", "llama-2-7b", "--tiers", "gold=1")


def test_a_parallel_calibration_adds_the_step_overhead_and_the_collective_latency(capsys, tmp_path):
    # what loadtest.calibrate.parallel writes beside the step times: both reach the plan's cost model
    cal = tmp_path / "cal.yaml"
    cal.write_text((EXAMPLES / "calibration-example.yaml").read_text()
                   + "step_overhead_s: 0.004\ncomm_latency_s: 0.00005\n")
    assert run("plan", EXAMPLES / "small-8gpu.yaml", "--model", "llama-2-7b", "--calibration", cal) == 0
    assert "4.0 ms per decode step on every rank, 50 us per collective" in capsys.readouterr().out
