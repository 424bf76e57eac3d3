import json

import numpy as np
import pytest

from shared.planner.config import Slo, WorkloadSpec, preset_workload
from shared.sim.traces import gamma, load_mooncake, poisson, synthetic_mooncake, write_mooncake

CHAT = WorkloadSpec(request_rate=50.0, input_len=1000, output_len=200, length_cv=0.5,
                    slo=Slo(ttft_s=1, tpot_s=0.1))


def test_poisson_rate_and_lengths():
    t = poisson(CHAT, 20_000, seed=1)
    gaps = np.diff(t.arrival_s)
    assert 1 / gaps.mean() == pytest.approx(50.0, rel=0.03)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)
    assert t.input_len.mean() == pytest.approx(1000, rel=0.03)
    assert t.input_len.std() / t.input_len.mean() == pytest.approx(0.5, rel=0.1)
    assert np.array_equal(poisson(CHAT, 100, seed=1).arrival_s, t.arrival_s[:100])


def test_gamma_is_bursty_with_the_same_mean_rate():
    t = gamma(CHAT, 50_000, cv=3.0, seed=2)
    gaps = np.diff(t.arrival_s)
    assert 1 / gaps.mean() == pytest.approx(50.0, rel=0.05)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(3.0, rel=0.1)


def test_classes_are_sampled_by_fraction():
    t = poisson(preset_workload("mixed"), 8000, seed=3)
    assert set(zip(t.input_len.tolist(), t.output_len.tolist())) == {(2048, 512), (2048, 64), (256, 512), (256, 64)}
    assert (t.input_len == 2048).mean() == pytest.approx(0.5, abs=0.03)


def test_mooncake_round_trip_and_shared_prefixes(tmp_path):
    t = synthetic_mooncake(CHAT, 500, num_prefixes=5, shared_fraction=0.5, seed=4)
    firsts = [h[0] for h in t.hash_ids if len(h) >= 2]
    assert len(set(firsts)) <= 5   # prefixes are shared
    path = tmp_path / "trace.jsonl"
    write_mooncake(t, path)
    back = load_mooncake(path)
    assert back.hash_ids == t.hash_ids
    assert np.array_equal(back.input_len, t.input_len)
    assert np.allclose(back.arrival_s, t.arrival_s - t.arrival_s[0], atol=1e-3)


def test_mooncake_loader_sorts_and_names_bad_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 2000, "input_length": 10, "output_length": 2, "hash_ids": [1]},
            {"timestamp": 1000, "input_length": 20, "output_length": 3, "hash_ids": [1, 2]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t = load_mooncake(path)
    assert t.arrival_s.tolist() == [0.0, 1.0] and t.input_len.tolist() == [20, 10]
    path.write_text(json.dumps(rows[0]) + "\n" + '{"timestamp": 5}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: not a Mooncake trace record"):
        load_mooncake(path)
