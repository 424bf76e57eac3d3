"""loadtest.calibrate.parallel: its fits, and one short run of the whole calibration on real ranks."""

import os

import pytest
import yaml

from loadtest.calibrate import parallel as cal
from shared.planner.config import load_calibration, load_cluster, load_model


def test_the_link_fit_recovers_latency_and_bandwidth():
    # all-reduces of rows x 512 float32 between 2 ranks: 40 us + (2 (tp-1)/tp · bytes) at 5 GB/s
    times = {rows: 40e-6 + rows * 512 * 4 / 5e9 for rows in (1, 4, 16, 64, 256)}
    latency, gbps = cal.fit_link(times, 2, 512)
    assert latency == pytest.approx(40e-6, rel=1e-6)
    assert gbps == pytest.approx(5.0, rel=1e-6)


def test_the_step_overhead_is_the_intercept_over_the_batch_and_the_slope_a_sequences_whole_cost():
    decode = [{"batch": b, "seconds": 0.02 + 0.001 * b} for b in (1, 2, 4, 8)]
    assert cal.step_overhead_s(decode) == (pytest.approx(0.02), pytest.approx(0.001))
    assert cal.step_overhead_s([{"batch": b, "seconds": 0.001 * b - 0.01} for b in (1, 2)])[0] == 0.0


def test_the_model_spec_counts_the_synthetic_shape(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"hidden_size": 512, "num_hidden_layers": 30, "intermediate_size": 1536, "vocab_size": 49152, '
        '"num_attention_heads": 8, "num_key_value_heads": 4}')
    spec = cal.model_spec(tmp_path)
    assert spec.num_params == pytest.approx(120e6, rel=0.01)  # the synthetic model's 120M parameters
    assert (spec.bytes_per_param, spec.act_bytes_per_elem, spec.kv_bytes_per_token()) == (4.0, 4.0, 2 * 30 * 4 * 64 * 4)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a group of 2 ranks needs 2 cores")
def test_one_short_calibration_writes_files_the_planner_reads(tmp_path, capsys):
    assert cal.main(["--repeats", "1", "--prompt-lens", "16,32", "--batch-sizes", "1,2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "TP=2  decode batch 2" in out and "median error" in out
    calibration = load_calibration(tmp_path / cal.CALIBRATION_FILE)
    assert calibration.step_overhead_s > 0 and calibration.comm_latency_s > 0
    assert [d.batch for d in calibration.decode] == [1, 2]
    assert load_model(calibration.model).num_kv_heads == 4
    assert load_cluster(tmp_path / cal.CLUSTER_FILE).nodes[0].num_gpus == len(os.sched_getaffinity(0))
    result = yaml.safe_load((tmp_path / "parallel_calibration.json").read_text())
    assert {r["group"] for r in result["rows"]} == {"TP=1", "TP=2"} and len(result["rows"]) == 8
    assert (tmp_path / "parallel_calibration.png").stat().st_size > 0
    assert calibration.prefill_reads_weights and calibration.fit_overheads
    assert calibration.decode_seq_undivided_s is not None
    assert load_cluster(tmp_path / cal.CLUSTER_FILE).nodes[0].memory_gbps > 0
    from services.cli import main  # the planner plans on what the calibration wrote

    assert main(["plan", str(tmp_path / cal.CLUSTER_FILE), "--model", calibration.model,
                 "--calibration", str(tmp_path / cal.CALIBRATION_FILE), "--rate", "1"]) == 0
    assert "ms per decode step on every rank" in capsys.readouterr().out
