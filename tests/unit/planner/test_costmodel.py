from dataclasses import replace

import pytest

from shared.planner.config import MODEL_PRESETS, GpuType, ModelSpec, Slo
from shared.planner.costmodel import (DecodeSample, Efficiency, GroupHardware, Parallel, PrefillSample,
                                      calibrate, decode_capacity, decode_step_s, kv_capacity_tokens, kv_transfer_s,
                                      parallel_options, prefill_capacity, prefill_latency_s, prefill_service_s)

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


def test_decode_batch_is_limited_by_kv_memory_when_tpot_is_loose():
    h, par = hw("a100", 2), Parallel(2, 1)
    cap = decode_capacity(LLAMA7, h, par, EFF, 1024, 256, SLO)
    ctx = 1024 + 128
    fits = kv_capacity_tokens(LLAMA7, h, par, EFF) // (1024 + 256)
    assert fits < EFF.max_decode_batch
    assert cap.batch == fits                 # memory binds: one more sequence's KV would not fit
    assert decode_step_s(LLAMA7, h, par, EFF, cap.batch, ctx) <= SLO.tpot_s
    assert cap.rate == pytest.approx(cap.batch / (cap.latency_s * 256))


def test_decode_batch_is_the_largest_meeting_a_tight_tpot():
    h, par = hw("a100", 2), Parallel(2, 1)
    tight = Slo(ttft_s=3.0, tpot_s=0.02)
    cap = decode_capacity(LLAMA7, h, par, EFF, 1024, 256, tight)
    ctx = 1024 + 128
    assert cap.batch < kv_capacity_tokens(LLAMA7, h, par, EFF) // (1024 + 256)   # memory does not bind
    assert decode_step_s(LLAMA7, h, par, EFF, cap.batch, ctx) <= tight.tpot_s
    assert decode_step_s(LLAMA7, h, par, EFF, cap.batch + 1, ctx) > tight.tpot_s
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


# ----- hand-computed cases -----
# The tests above mostly check the model against itself (scaling, monotonicity, round trips).
# These pin its absolute numbers on a toy model with round figures, the arithmetic written out,
# so a wrong constant or a term counted twice turns them red.

TOY = ModelSpec(name="toy", num_layers=10, hidden_size=1000, num_heads=10, num_kv_heads=10, vocab_size=1000,
                num_params=1e9)     # 2-byte weights and KV: weights 2e9 B; KV 2·10·10·100·2 = 40,000 B/token
TOY_GPU = GpuType(tflops_bf16=100, hbm_gib=80, hbm_gbps=1000, price_per_hour=1.0)
TOY_EFF = Efficiency(compute=0.5, hbm=0.5, link=0.5, comm_latency_s=1e-3)   # pp_bubble 0.15, mem 0.9


def toy_hw(link_gbps=100.0):
    return GroupHardware(gpu=TOY_GPU, tp_link_gbps=link_gbps, pp_link_gbps=link_gbps, price_per_hour=1.0)


def test_toy_model_sizes():
    assert TOY.weight_bytes == 2e9
    assert TOY.kv_bytes_per_token() == 40_000
    # 80 GiB · 0.9 = 77,309,411,328 B; minus 2e9 B of weights = 75,309,411,328 B; / 40,000 B per token
    assert kv_capacity_tokens(TOY, toy_hw(), Parallel(1, 1), TOY_EFF) == pytest.approx(1_882_735.2832)


def test_toy_prefill_latency_by_hand():
    # 1000 tokens: FLOPs 2·1e9·1000 + 2·10·1000·1000² = 2e12 + 2e10 = 2.02e12,
    # at 100 TFLOP/s · 0.5 = 5e13 FLOP/s -> 0.0404 s
    assert prefill_latency_s(TOY, toy_hw(), Parallel(1, 1), TOY_EFF, 1000) == pytest.approx(0.0404)
    # TP 2: compute 2.02e12 / 1e14 = 0.0202 s; activations 1000·1000·2 = 2e6 B; one ring all-reduce
    # 1e-3 + 2·(1/2)·2e6 / (100e9·0.5) = 1e-3 + 4e-5 = 1.04e-3 s, two per layer: 20 · 1.04e-3 = 0.0208 s
    assert prefill_latency_s(TOY, toy_hw(), Parallel(2, 1), TOY_EFF, 1000) == pytest.approx(0.0202 + 0.0208)
    # PP 2: compute 0.0404 s plus one hop 1e-3 + 2e6 / 5e10 = 1.04e-3 s -> 0.04144 s; stages overlap,
    # so a prompt is served every 0.04144 / 2 · (1 + 0.15 · 1/2) = 0.022274 s
    assert prefill_latency_s(TOY, toy_hw(), Parallel(1, 2), TOY_EFF, 1000) == pytest.approx(0.04144)
    assert prefill_service_s(TOY, toy_hw(), Parallel(1, 2), TOY_EFF, 1000) == pytest.approx(0.022274)
    # a fixed overhead adds as is: 0.0404 + 0.1
    slow = replace(TOY_EFF, prefill_overhead_s=0.1)
    assert prefill_latency_s(TOY, toy_hw(), Parallel(1, 1), slow, 1000) == pytest.approx(0.1404)


def test_toy_decode_step_by_hand():
    # batch 4 at 1000 tokens: read 2e9 + 4·1000·40,000 = 2.16e9 B at 1000 GB/s · 0.5 -> 4.32e-3 s;
    # FLOPs 2·1e9·4 = 8e9 at 5e13 -> 1.6e-4 s: memory-bound, 4.32e-3 s
    assert decode_step_s(TOY, toy_hw(), Parallel(1, 1), TOY_EFF, 4, 1000) == pytest.approx(4.32e-3)
    # plus 1 ms per running sequence: 4.32e-3 + 4 · 1e-3
    per_seq = replace(TOY_EFF, decode_seq_s=1e-3)
    assert decode_step_s(TOY, toy_hw(), Parallel(1, 1), per_seq, 4, 1000) == pytest.approx(8.32e-3)
    # batch 512 at 10 tokens: read 2e9 + 512·10·40,000 = 2.2048e9 B -> 4.4096e-3 s;
    # FLOPs 2·1e9·512 = 1.024e12 at 5e13 -> 0.02048 s: compute-bound
    assert decode_step_s(TOY, toy_hw(), Parallel(1, 1), TOY_EFF, 512, 10) == pytest.approx(0.02048)


def test_toy_kv_transfer_by_hand():
    # 1000 tokens · 40,000 B = 4e7 B over 50 GB/s · 0.5 = 1.6e-3 s, plus 1e-3 s fixed
    assert kv_transfer_s(TOY, 1000, 50.0, TOY_EFF) == pytest.approx(2.6e-3)


def test_calibrate_from_hand_computed_step_times():
    # Step times of a device running the toy model at 40% of its FLOP/s and 60% of its bandwidth:
    # prefill of 1000 tokens: 2.02e12 FLOPs / (100e12 · 0.4) = 0.0505 s;
    # prefill of 100 tokens: (2e11 + 2·10·1000·100²) = 2.002e11 FLOPs / 4e13 = 5.005e-3 s;
    # decode batch 1 at 1000 tokens: (2e9 + 4e7) B / (1000e9 · 0.6) = 3.4e-3 s;
    # decode batch 8 at 1000 tokens: (2e9 + 3.2e8) B / 6e11 = 3.8666...e-3 s
    pre = [PrefillSample(1000, 0.0505), PrefillSample(100, 5.005e-3)]
    dec = [DecodeSample(1, 1000, 3.4e-3), DecodeSample(8, 1000, 2.32e9 / 6e11)]
    fitted = calibrate(TOY, TOY_GPU, pre, dec)
    assert fitted.compute == pytest.approx(0.4, rel=1e-9)
    assert fitted.hbm == pytest.approx(0.6, rel=1e-9)


def test_a_step_overhead_is_paid_whole_by_every_tensor_parallel_size():
    # a decode step of TP=2 halves the weight read but not the fixed cost every rank's step makes
    h = hw("a100")
    plain, with_overhead = replace(EFF, comm_latency_s=0.0), replace(EFF, comm_latency_s=0.0, step_overhead_s=0.01)
    for tp in (1, 2, 4):
        par = Parallel(tp, 1)
        assert (decode_step_s(LLAMA7, h, par, with_overhead, 4, 512) - decode_step_s(LLAMA7, h, par, plain, 4, 512)
                == pytest.approx(0.01))


def test_calibrate_takes_a_measured_step_overhead_out_before_fitting_and_keeps_it():
    truth = replace(EFF, hbm=0.6, decode_seq_s=2e-4, step_overhead_s=3e-3)
    h, one = hw("a100"), Parallel(1, 1)
    dec = [DecodeSample(b, 512, decode_step_s(LLAMA7, h, one, truth, b, 512)) for b in (1, 8, 32)]
    fitted = calibrate(LLAMA7, GPU_TYPES["a100"], [], dec, base=replace(EFF, step_overhead_s=3e-3), fit_overheads=True)
    assert fitted.hbm == pytest.approx(0.6, rel=1e-6)
    assert fitted.decode_seq_s == pytest.approx(2e-4, rel=1e-6)
    assert fitted.step_overhead_s == 3e-3
    for d in dec:
        assert decode_step_s(LLAMA7, h, one, fitted, d.batch, d.context_len) == pytest.approx(d.seconds, rel=1e-6)


def test_cores_sharing_memory_read_no_faster_together_than_the_node_allows():
    # two ranks each reading half the weights: twice as fast as one alone, unless the node caps them
    one, two = Parallel(1, 1), Parallel(2, 1)
    eff = replace(EFF, comm_latency_s=0.0)
    free, capped = hw("a100"), replace(hw("a100"), node_hbm_gbps=hw("a100").gpu.hbm_gbps)  # the node: one device's
    assert decode_step_s(LLAMA7, free, two, eff, 1, 16) == pytest.approx(decode_step_s(LLAMA7, free, one, eff, 1, 16) / 2,
                                                                          rel=0.01)
    assert decode_step_s(LLAMA7, capped, two, eff, 1, 16) == pytest.approx(decode_step_s(LLAMA7, free, one, eff, 1, 16),
                                                                            rel=0.01)


def test_a_prefill_that_reads_the_weights_is_fitted_with_that_read_taken_out_first():
    # CPU-like truth: every prefill reads the weights once at the bandwidth the decode steps show
    truth = replace(EFF, compute=0.3, hbm=0.5, decode_seq_s=1e-4, prefill_overhead_s=2e-3, prefill_reads_weights=True)
    h, one = hw("a100"), Parallel(1, 1)
    pre = [PrefillSample(t, prefill_latency_s(LLAMA7, h, one, truth, t)) for t in (16, 64, 256)]
    dec = [DecodeSample(b, 512, decode_step_s(LLAMA7, h, one, truth, b, 512)) for b in (1, 4, 16)]
    fitted = calibrate(LLAMA7, GPU_TYPES["a100"], pre, dec, base=replace(EFF, prefill_reads_weights=True),
                       fit_overheads=True)
    assert (fitted.compute, fitted.hbm) == (pytest.approx(0.3, rel=1e-6), pytest.approx(0.5, rel=1e-6))
    assert fitted.prefill_overhead_s == pytest.approx(2e-3, rel=1e-5)
    # TP=2 halves the weights' read as it halves the arithmetic; the fixed cost stays
    two = Parallel(2, 1)
    weights_s = LLAMA7.weight_bytes / (h.gpu.hbm_gbps * 1e9 * 0.5)
    assert (prefill_latency_s(LLAMA7, h, one, fitted, 16) - prefill_latency_s(LLAMA7, h, two, replace(
        fitted, comm_latency_s=0.0), 16)) == pytest.approx(weights_s / 2 + (prefill_latency_s(
            LLAMA7, h, one, replace(fitted, prefill_reads_weights=False), 16) - 2e-3) / 2, rel=0.01)


def test_a_sequences_cost_splits_into_what_every_rank_pays_and_what_the_ranks_share():
    truth = replace(EFF, hbm=0.6, decode_seq_s=1e-4, decode_seq_tp_s=3e-4, comm_latency_s=0.0)
    h, one, two = hw("a100"), Parallel(1, 1), Parallel(2, 1)
    dec = [DecodeSample(b, 512, decode_step_s(LLAMA7, h, one, truth, b, 512)) for b in (1, 8, 32)]
    fitted = calibrate(LLAMA7, GPU_TYPES["a100"], [], dec, fit_overheads=True, seq_undivided_s=1e-4)
    assert (fitted.decode_seq_s, fitted.decode_seq_tp_s) == (pytest.approx(1e-4), pytest.approx(3e-4))
    none = replace(fitted, decode_seq_s=0.0, decode_seq_tp_s=0.0)
    for par, per_seq in ((one, 4e-4), (two, 1e-4 + 3e-4 / 2)):  # TP=2 halves the shared part alone
        assert (decode_step_s(LLAMA7, h, par, fitted, 8, 512) - decode_step_s(LLAMA7, h, par, none, 8, 512)
                == pytest.approx(8 * per_seq, rel=1e-6))
