"""The calibration fit (costmodel.calibrate with fit_overheads) and the pure helpers of
loadtest/calibrate/sim.py. Synthetic step times only (from the cost model, or worked out by hand);
nothing is timed."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from loadtest.calibrate.sim import compare, cpu_cluster_spec, p50_p90, relative_error
from shared.planner.config import MODEL_PRESETS, ClusterSpec, GpuType
from shared.planner.costmodel import (DecodeSample, Efficiency, GroupHardware, Parallel, PrefillSample,
                                      calibrate, decode_step_s, prefill_latency_s)
from toy_model import TOY

MODEL = MODEL_PRESETS["smollm2-135m"].model_copy(update={"bytes_per_param": 4.0, "kv_bytes_per_elem": 4.0})
CPU = GpuType(tflops_bf16=1.0, hbm_gib=2.0, hbm_gbps=100.0, price_per_hour=0.0)
HW = GroupHardware(gpu=CPU, tp_link_gbps=1.0, pp_link_gbps=1.0, price_per_hour=0.0)
ONE = Parallel(1, 1)
CPU_NOMINAL = ClusterSpec.model_validate(cpu_cluster_spec(10.0)).gpu_types["cpu"]   # 1 TFLOP/s, 100 GB/s


def samples(truth: Efficiency):
    pre = [PrefillSample(n, prefill_latency_s(MODEL, HW, ONE, truth, n)) for n in (16, 64, 256)]
    dec = [DecodeSample(b, 72, decode_step_s(MODEL, HW, ONE, truth, b, 72)) for b in (1, 2, 4, 8)]
    return pre, dec


def test_fit_recovers_efficiencies_and_overheads():
    truth = replace(Efficiency(), compute=0.36, hbm=0.23, prefill_overhead_s=0.04, decode_seq_s=0.005)
    fitted = calibrate(MODEL, CPU, *samples(truth), fit_overheads=True)
    assert fitted.compute == pytest.approx(0.36, rel=1e-6)
    assert fitted.hbm == pytest.approx(0.23, rel=1e-6)
    assert fitted.prefill_overhead_s == pytest.approx(0.04, rel=1e-6)
    assert fitted.decode_seq_s == pytest.approx(0.005, rel=1e-6)


def test_fit_without_overheads_in_the_data_finds_none():
    truth = replace(Efficiency(), compute=0.5, hbm=0.4)
    fitted = calibrate(MODEL, CPU, *samples(truth), fit_overheads=True)
    assert fitted.compute == pytest.approx(0.5, rel=1e-6)
    assert fitted.hbm == pytest.approx(0.4, rel=1e-6)
    assert fitted.prefill_overhead_s == pytest.approx(0.0, abs=1e-9)
    assert fitted.decode_seq_s == pytest.approx(0.0, abs=1e-9)


def test_fit_caps_efficiency_at_one_and_keeps_terms_non_negative():
    # Faster than the nominal figures allow: efficiencies capped at 1, added terms still >= 0.
    pre = [PrefillSample(n, 1e-6 * n) for n in (16, 64, 256)]
    dec = [DecodeSample(b, 72, 1e-4) for b in (1, 2, 4)]
    fitted = calibrate(MODEL, CPU, pre, dec, fit_overheads=True)
    assert fitted.compute == 1.0 and fitted.hbm == 1.0
    assert fitted.prefill_overhead_s >= 0 and fitted.decode_seq_s >= 0


def test_default_calibrate_adds_no_overhead_terms():
    truth = replace(Efficiency(), compute=0.36, hbm=0.23, prefill_overhead_s=0.04, decode_seq_s=0.005)
    fitted = calibrate(MODEL, CPU, *samples(truth))
    assert fitted.prefill_overhead_s == 0.0 and fitted.decode_seq_s == 0.0


def test_overhead_terms_enter_step_times():
    eff = replace(Efficiency(), prefill_overhead_s=0.01, decode_seq_s=0.002)
    base = replace(eff, prefill_overhead_s=0.0, decode_seq_s=0.0)
    assert prefill_latency_s(MODEL, HW, ONE, eff, 64) == pytest.approx(prefill_latency_s(MODEL, HW, ONE, base, 64) + 0.01)
    assert decode_step_s(MODEL, HW, ONE, eff, 4, 72) == pytest.approx(decode_step_s(MODEL, HW, ONE, base, 4, 72) + 0.008)


def test_compare_and_relative_error():
    assert relative_error(1.2, 1.0) == pytest.approx(0.2)
    rows = compare({"ttft": {"p50": 0.12, "p90": 0.3}}, {"ttft": {"p50": 0.1, "p90": 0.2}}, 0.25)
    assert rows["ttft_p50"]["within_tolerance"] is True
    assert rows["ttft_p90"]["rel_error"] == pytest.approx(0.5) and "within_tolerance" not in rows["ttft_p90"]
    assert compare({"itl": {"p50": 0.05}}, {"itl": {"p50": 0.03}}, 0.25)["itl_p50"]["within_tolerance"] is False


def test_percentiles_skip_missing_values_and_cluster_spec_validates():
    q = p50_p90([1.0, None, 3.0, math.nan, 2.0])
    assert q["p50"] == 2.0
    spec = ClusterSpec.model_validate(cpu_cluster_spec(2.0))
    assert spec.num_gpus == 1 and spec.gpu_types["cpu"].hbm_gib == 2.0


def test_fit_of_hand_computed_step_times():
    # The toy model (toy_model.py) on the nominal CPU device, at compute and HBM efficiency 0.5,
    # 0.1 s per prefill and 0.01 s per sequence per decode step, worked out by hand:
    # prefill  100 tokens: (2e11 + 2·10·1000·1e4 = 2.002e11 FLOPs) / 5e11 + 0.1 = 0.5004 s
    # prefill  200 tokens: (4e11 + 8e8 = 4.008e11) / 5e11 + 0.1 = 0.9016 s
    # prefill  400 tokens: (8e11 + 3.2e9 = 8.032e11) / 5e11 + 0.1 = 1.7064 s
    # decode at context 100 (memory-bound; FLOPs 2e9·B / 5e11 stay below the read time):
    #   B=1: (2e9 + 4e6) / 5e10 + 0.01 = 0.05008 s      B=2: (2e9 + 8e6) / 5e10 + 0.02 = 0.06016 s
    #   B=4: (2e9 + 1.6e7) / 5e10 + 0.04 = 0.08032 s    B=8: (2e9 + 3.2e7) / 5e10 + 0.08 = 0.12064 s
    pre = [PrefillSample(100, 0.5004), PrefillSample(200, 0.9016), PrefillSample(400, 1.7064)]
    dec = [DecodeSample(1, 100, 0.05008), DecodeSample(2, 100, 0.06016), DecodeSample(4, 100, 0.08032),
           DecodeSample(8, 100, 0.12064)]
    fitted = calibrate(TOY, CPU_NOMINAL, pre, dec, fit_overheads=True)
    assert fitted.compute == pytest.approx(0.5, rel=1e-6)
    assert fitted.hbm == pytest.approx(0.5, rel=1e-6)
    assert fitted.prefill_overhead_s == pytest.approx(0.1, rel=1e-6)
    assert fitted.decode_seq_s == pytest.approx(0.01, rel=1e-6)
