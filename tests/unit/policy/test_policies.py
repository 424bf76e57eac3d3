import numpy as np
import pytest

from shared.policy.admission import AdmissionConfig, AdmissionInput, admit, predict_ttft_s
from shared.policy.autoscale import AutoscaleConfig, RatioAutoscaler, TickInput
from shared.policy.disagg import DisaggConfig, DisaggInput, decide_prefill
from shared.policy.routing import RoutingInput, RoutingWeights, choose_worker, route_costs

# --- conditional disaggregation -----------------------------------------------------------------


def test_short_uncached_prompts_prefill_locally():
    cfg = DisaggConfig(max_local_prefill_tokens=512, max_prefill_queue=10)
    assert not decide_prefill(DisaggInput(0.0, 400, 0, 0), cfg).remote
    assert decide_prefill(DisaggInput(0.0, 4000, 0, 0), cfg).remote
    # a long prompt whose prefix is cached is short once uncached
    d = decide_prefill(DisaggInput(0.0, 4000, 3600, 0), cfg)
    assert not d.remote and d.uncached_tokens == 400


def test_long_prefill_queue_or_no_prefill_workers_keeps_it_local():
    cfg = DisaggConfig(max_local_prefill_tokens=512, max_prefill_queue=10)
    assert not decide_prefill(DisaggInput(0.0, 4000, 0, 10), cfg).remote
    assert decide_prefill(DisaggInput(0.0, 4000, 0, 9), cfg).remote
    assert not decide_prefill(DisaggInput(0.0, 4000, 0, 0, has_prefill_workers=False), cfg).remote

# --- routing -------------------------------------------------------------------------------------


def test_routing_trades_overlap_against_load():
    active = np.array([100.0, 10.0, 50.0])
    inp = RoutingInput(0.0, num_prompt_blocks=64, overlap_blocks={2: 60}, active_blocks=active)
    # costs: 100+64, 10+64, 50+4 -> worker 2 (its cache saves more than its load costs)
    assert list(route_costs(inp)) == [164.0, 74.0, 54.0]
    assert choose_worker(inp).worker == 2
    assert choose_worker(inp, RoutingWeights(overlap_weight=0.1)).worker == 1


def test_routing_skips_ineligible_and_breaks_ties_low():
    active = np.array([5.0, 5.0, 5.0])
    assert choose_worker(RoutingInput(0.0, 4, {}, active)).worker == 0
    eligible = np.array([False, True, True])
    assert choose_worker(RoutingInput(0.0, 4, {}, active, eligible)).worker == 1
    none = choose_worker(RoutingInput(0.0, 4, {}, active, np.zeros(3, dtype=bool)))
    assert none.worker is None

# --- admission ------------------------------------------------------------------------------------


def _adm(tier="standard", queued=0.0, prompt=1000, cached=0, queued_requests=0, wait=0.0):
    return AdmissionInput(now_s=0.0, tier=tier, prompt_tokens=prompt, cached_tokens=cached,
                          queued_prefill_tokens=queued, prefill_tokens_per_s=10_000.0,
                          queued_requests=queued_requests, transfer_s=0.05, decode_wait_s=wait)


def test_predicted_ttft_is_backlog_over_rate():
    assert predict_ttft_s(_adm(queued=9000, prompt=1000)) == pytest.approx(1.0 + 0.05)
    assert predict_ttft_s(_adm(queued=0, prompt=1000, cached=500, wait=0.5)) == pytest.approx(0.05 + 0.05 + 0.5)


def test_early_rejection_against_slo_with_retry_after():
    cfg = AdmissionConfig(ttft_slo_s=1.0)
    assert admit(_adm(queued=5000), cfg).admitted
    d = admit(_adm(queued=20_000), cfg)
    assert not d.admitted and d.retry_after_s >= cfg.retry_after_s and "predicted TTFT" in d.reason


def test_qos_tiers_shed_batch_first_and_keep_premium_longest():
    cfg = AdmissionConfig(ttft_slo_s=1.0)
    load = _adm(queued=12_000)   # predicted TTFT 1.35 s
    assert [admit(AdmissionInput(**{**load.__dict__, "tier": t}), cfg).admitted
            for t in ("premium", "standard", "batch")] == [True, False, False]
    assert not admit(_adm(tier="batch", queued_requests=1_000), cfg).admitted
    with pytest.raises(ValueError, match="unknown tier"):
        admit(_adm(tier="gold"), cfg)


def test_too_long_prompt_is_rejected_without_retry():
    d = admit(_adm(prompt=200_000), AdmissionConfig(ttft_slo_s=100.0, max_prompt_tokens=131_072))
    assert not d.admitted and d.retry_after_s == 0

# --- autoscaling ----------------------------------------------------------------------------------


def _tick(now, num_p, num_d, p_demand, d_demand):
    return TickInput(now_s=now, num_prefill=num_p, num_decode=num_d, prefill_tokens_per_s=p_demand,
                     decode_tokens_per_s=d_demand, prefill_capacity_tokens_per_s=10_000,
                     decode_capacity_tokens_per_s=1_000)


def test_autoscaler_moves_workers_toward_the_demand_ratio():
    scaler = RatioAutoscaler(AutoscaleConfig(cooldown_s=60, max_flips_per_tick=8))
    # prefill needs 6 workers, decode 2 -> of 8 workers, 6 should prefill
    d = scaler.tick(_tick(0.0, 2, 6, 60_000, 2_000))
    assert (d.target_prefill, d.target_decode, d.flips) == (6, 2, 4)


def test_autoscaler_cooldown_hysteresis_and_minimums():
    scaler = RatioAutoscaler(AutoscaleConfig(cooldown_s=60, hysteresis=0.15, max_flips_per_tick=8))
    assert scaler.tick(_tick(0.0, 2, 6, 60_000, 2_000)).flips == 4
    assert scaler.tick(_tick(30.0, 6, 2, 10_000, 7_000)).flips == 0       # cooling down
    assert scaler.tick(_tick(61.0, 4, 4, 41_000, 4_000)).flips == 0       # within hysteresis
    d = scaler.tick(_tick(200.0, 4, 4, 0, 8_000))                         # all decode demand
    assert d.target_prefill == 1 and d.target_decode == 7                 # min_prefill kept
    assert RatioAutoscaler().tick(_tick(0.0, 4, 4, 0, 0)).flips == 0      # no load, no change
