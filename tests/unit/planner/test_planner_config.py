from pathlib import Path

import pytest

from shared.planner.config import (ConfigError, WorkloadSpec, load_cluster, load_model, load_workload,
                                   preset_workload)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "clusters"


@pytest.mark.parametrize("name", ["het1", "het2", "het3", "het4", "het5", "homo-h100x8", "small-8gpu",
                                  "mixed-256"])
def test_example_clusters_load(name):
    spec = load_cluster(EXAMPLES / f"{name}.yaml")
    assert spec.num_gpus > 0 and spec.price_per_hour() > 0


def test_example_workloads_and_model_load():
    mixed = load_workload(str(EXAMPLES / "workload-mixed.yaml"))
    assert len(mixed.class_mix()) == 4 and abs(sum(c.fraction for c in mixed.class_mix()) - 1) < 1e-9
    chat = load_workload(str(EXAMPLES / "workload-chat.yaml"), request_rate=3.0)
    assert chat.request_rate == 3.0 and chat.mean_lengths() == (1024, 256)
    assert load_model(str(EXAMPLES / "llama-2-70b.yaml")) == load_model("llama-2-70b")


def test_unknown_gpu_type_names_the_node(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("gpu_types: {a100: {tflops_bf16: 312, hbm_gib: 80, hbm_gbps: 2039, price_per_hour: 2}}\n"
                   "inter_node_gbps: 12.5\nnodes: [{name: x, gpu_type: v100, num_gpus: 8, intra_gbps: 300}]\n")
    with pytest.raises(ConfigError, match=r"nodes\[x\].gpu_type 'v100'"):
        load_cluster(bad)


def test_missing_field_is_one_line_with_location(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("gpu_types: {a100: {tflops_bf16: 312, hbm_gib: 80, price_per_hour: 2}}\n"
                   "inter_node_gbps: 12.5\nnodes: [{name: x, gpu_type: a100, num_gpus: 8, intra_gbps: 300}]\n")
    with pytest.raises(ConfigError) as err:
        load_cluster(bad)
    assert "gpu_types.a100.hbm_gbps" in str(err.value) and "\n" not in str(err.value)


def test_workload_needs_means_or_classes_not_both():
    with pytest.raises(ValueError, match="either input_len and output_len, or classes"):
        WorkloadSpec(request_rate=1, input_len=10, output_len=10, slo={"ttft_s": 1, "tpot_s": 0.1},
                     classes=[{"name": "a", "fraction": 1, "input_len": 1, "output_len": 1}])


def test_unknown_presets_are_config_errors():
    with pytest.raises(ConfigError, match="neither a preset"):
        load_model("gpt-5")
    with pytest.raises(ConfigError, match="unknown workload preset"):
        load_workload("nope")
    assert preset_workload("lpsd").mean_lengths() == (2048, 64)


def test_tail_input_len_is_the_lognormal_p90():
    import numpy as np
    w = WorkloadSpec(request_rate=1, input_len=1000, output_len=10, length_cv=0.6, slo={"ttft_s": 1, "tpot_s": 0.1})
    sigma2 = np.log1p(0.36)
    samples = np.random.default_rng(0).lognormal(np.log(1000) - sigma2 / 2, np.sqrt(sigma2), 200_000)
    assert w.tail_input_len() == pytest.approx(np.percentile(samples, 90), rel=0.01)
