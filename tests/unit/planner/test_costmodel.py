from dataclasses import replace

import pytest

from shared.planner.config import MODEL_PRESETS, Slo
from shared.planner.costmodel import (DecodeSample, Efficiency, GroupHardware, Parallel, PrefillSample,
                                      calibrate, decode_capacity, decode_step_s, kv_capacity_tokens,
                                      parallel_options, prefill_capacity, prefill_latency_s)

from planner_helpers import GPU_TYPES

LLAMA70, LLAMA7 = MODEL_PRESETS["llama-2-70b"], MODEL_PRESETS["llama-2-7b"]
EFF = Efficiency()
SLO = Slo(ttft_s=3.0, tpot_s=0.1)


def hw(name, n=1, link=300.0):
    gpu = GPU_TYPES[name]
    return GroupHardware(gpu=gpu, tp_link_gbps=link, pp_link_gbps=link, price_per_hour=gpu.price_per_hour * n)


def test_prefill_is_compute_bound_and_scales_with_tp():
    one = prefill_latency_s(LLAMA7, hw("a100"), Parallel(1, 1), EFF, 2048)
    four = prefill_latency_s(LLAMA7, hw("a100", 4), Parallel(4, 1), EFF, 2048)
    faster_gpu = prefill_latency_s(LLAMA7, hw("h100"), Parallel(1, 1), EFF, 2048)
    assert one / 4 < four < one / 2          # near-linear, all-reduce costs something
    assert faster_gpu == pytest.approx(one * 312 / 989, rel=1e-6)
    # FLOPs: 2·P·T plus causal attention 2·L·h·T²
    flops = 2 * LLAMA7.num_params * 2048 + 2 * LLAMA7.num_layers * LLAMA7.hidden_size * 2048**2
    assert one == pytest.approx(flops / (312e12 * EFF.compute))


def test_decode_is_memory_bound_and_grows_with_batch():
    a100 = decode_step_s(LLAMA7, hw("a100"), Parallel(1, 1), EFF, 1, 1024)
    read = LLAMA7.weight_bytes + 1024 * LLAMA7.kv_bytes_per_token()   # weights + one sequence's KV
    assert a100 == pytest.approx(read / (2039e9 * EFF.hbm), rel=1e-6)
    assert decode_step_s(LLAMA7, hw("a100"), Parallel(1, 1), EFF, 64, 1024) > a100 * 1.5
    assert decode_step_s(LLAMA7, hw("h100"), Parallel(1, 1), EFF, 1, 1024) < a100


def test_weights_that_do_not_fit_give_no_capacity():
    assert kv_capacity_tokens(LLAMA70, hw("l40"), Parallel(1, 1), EFF) < 0
    assert prefill_capacity(LLAMA70, hw("l40"), Parallel(1, 1), EFF, 1024, SLO).rate == 0
    assert decode_capacity(LLAMA70, hw("l40"), Parallel(1, 1), EFF, 1024, 256, SLO).rate == 0
    assert decode_capacity(LLAMA70, hw("l40", 4, 25), Parallel(4, 1), EFF, 1024, 256, SLO).rate > 0


def test_decode_batch_is_the_largest_meeting_tpot():
    h, par = hw("a100", 2), Parallel(2, 1)
    cap = decode_capacity(LLAMA7, h, par, EFF, 1024, 256, SLO)
    ctx = 1024 + 128
    assert decode_step_s(LLAMA7, h, par, EFF, cap.batch, ctx) <= SLO.tpot_s
    fits = kv_capacity_tokens(LLAMA7, h, par, EFF) // (1024 + 256)
    assert cap.batch == min(fits, EFF.max_decode_batch) or \
        decode_step_s(LLAMA7, h, par, EFF, cap.batch + 1, ctx) > SLO.tpot_s
    assert cap.rate == pytest.approx(cap.batch / (cap.latency_s * 256))


def test_prefill_capacity_keeps_mdl_queue_within_ttft():
    h, par = hw("a100"), Parallel(1, 1)
    cap = prefill_capacity(LLAMA7, h, par, EFF, 2048, SLO)
    mu = 1 / cap.latency_s
    rho = cap.rate / mu
    assert 0 < rho < 1
    assert cap.latency_s + rho / (2 * mu * (1 - rho)) == pytest.approx(SLO.ttft_s)
    tight = prefill_capacity(LLAMA7, h, par, EFF, 2048, Slo(ttft_s=cap.latency_s * 0.9, tpot_s=0.1))
    assert tight.rate == 0


def test_parallel_options_keep_tp_in_node():
    assert [(p.tp, p.pp) for p in parallel_options(8, 4)] == [(1, 8), (2, 4), (4, 2)]
    assert [(p.tp, p.pp) for p in parallel_options(3, 8)] == [(1, 3)]


def test_calibrate_recovers_efficiencies():
    truth = replace(EFF, compute=0.4, hbm=0.6)
    h, one = hw("a100"), Parallel(1, 1)
    pre = [PrefillSample(t, prefill_latency_s(LLAMA7, h, one, truth, t)) for t in (128, 512, 2048)]
    dec = [DecodeSample(b, 512, decode_step_s(LLAMA7, h, one, truth, b, 512)) for b in (1, 8, 32)]
    fitted = calibrate(LLAMA7, GPU_TYPES["a100"], pre, dec)
    assert fitted.compute == pytest.approx(0.4, rel=1e-6)
    assert fitted.hbm == pytest.approx(0.6, rel=1e-6)


def test_ttft_must_hold_for_the_long_prompts_not_just_the_mean():
    from shared.planner.config import preset_workload
    assert preset_workload("mixed").tail_input_len() == 2048
    h, par = hw("a100"), Parallel(1, 1)
    mean_only = prefill_capacity(LLAMA7, h, par, EFF, 1152, SLO)
    with_tail = prefill_capacity(LLAMA7, h, par, EFF, 1152, SLO, tail_input_len=2048)
    assert 0 < with_tail.rate < mean_only.rate
    mu = 1 / prefill_latency_s(LLAMA7, h, par, EFF, 1152)
    rho = with_tail.rate / mu
    tail_latency = prefill_latency_s(LLAMA7, h, par, EFF, 2048)
    assert tail_latency + rho / (2 * mu * (1 - rho)) == pytest.approx(SLO.ttft_s)
    slow = prefill_capacity(LLAMA7, h, par, EFF, 1152, Slo(ttft_s=tail_latency * 0.99, tpot_s=0.1),
                            tail_input_len=2048)
    assert slow.rate == 0
