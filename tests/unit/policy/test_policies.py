import numpy as np
import pytest

from shared.policy.admission import AdmissionConfig, AdmissionInput, admit, predict_ttft_s
from shared.policy.autoscale import AutoscaleConfig, RatioAutoscaler, TickInput
from shared.policy.disagg import DisaggConfig, DisaggInput, decide_prefill
from shared.policy.kv_routing import RoutingWeights, WorkerLoadView
from shared.policy.kv_routing import choose_worker as kv_choose_worker
from shared.policy.routing import RoutingInput, choose_worker, route_costs

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
    unknown = decide_prefill(DisaggInput(0.0, 4000, 0, None), cfg)  # the queue could not be read
    assert (unknown.remote, unknown.reason) == (False, "prefill queue state unknown")


def test_disagg_moves_only_whole_blocks():
    cfg = DisaggConfig(max_local_prefill_tokens=0)
    assert decide_prefill(DisaggInput(0.0, 40, 16, 0, block_size=16), cfg).remote  # block 1 is whole
    d = decide_prefill(DisaggInput(0.0, 40, 32, 0, block_size=16), cfg)  # 8 uncached: no whole block
    assert not d.remote and "no whole 16-token block" in d.reason
    assert not decide_prefill(DisaggInput(0.0, 6, 0, 0, block_size=16), cfg).remote

# --- routing (array form of shared.policy.kv_routing) ---------------------------------------------


def _route(active, waiting, overlap, n=64, eligible=None, w=RoutingWeights()):
    return choose_worker(RoutingInput(0.0, n, overlap, np.array(active, float), np.array(waiting, float),
                                      eligible), w)


def test_routing_trades_overlap_against_load():
    inp = RoutingInput(0.0, 64, {2: 60}, np.array([100.0, 10.0, 50.0]), np.zeros(3))
    # overlap_weight·(64 - overlap) + active + 64: 228, 138, 118 -> worker 2 (its cache saves more)
    assert list(route_costs(inp)) == [228.0, 138.0, 118.0]
    assert choose_worker(inp).worker == 2 and choose_worker(inp).overlap_blocks == 60
    assert choose_worker(inp, RoutingWeights(overlap_weight=0.1)).worker == 1


def test_routing_queue_limit_eligibility_and_ties():
    assert _route([5, 5, 5], [0, 0, 0], {}).worker == 0
    assert _route([5, 5, 5], [32, 0, 0], {}).worker == 1                 # at the queue limit
    assert _route([5, 5, 5], [0, 0, 0], {}, eligible=np.array([False, True, True])).worker == 1
    assert _route([5, 5, 5], [32, 32, 32], {}).worker is None
    # equal cost: fewer active blocks wins (worker 1: 4 + 4·waiting 1 = worker 0: 8)
    assert _route([8, 4], [0, 1], {}, w=RoutingWeights(queue_weight=4.0)).worker == 1


def test_array_routing_agrees_with_the_service_policy():
    rng = np.random.default_rng(0)
    for _ in range(500):
        k = int(rng.integers(1, 12))
        active = rng.integers(0, 20, size=k).astype(float)
        waiting = rng.integers(0, 4, size=k).astype(float)
        n = int(rng.integers(1, 10))
        overlap = {int(i): int(rng.integers(0, 12)) for i in rng.choice(k, size=int(rng.integers(0, k + 1)),
                                                                       replace=False)}
        weights = RoutingWeights(overlap_weight=float(rng.choice([0.0, 1.0, 2.5])), queue_weight=4.0,
                                 max_waiting_per_worker=3)
        views = [WorkerLoadView(f"w{i:03d}", int(active[i]), int(waiting[i])) for i in range(k)]
        expected = kv_choose_worker(views, {f"w{i:03d}": b for i, b in overlap.items()}, n, weights)
        got = _route(active, waiting, overlap, n=n, w=weights)
        assert (f"w{got.worker:03d}" if got.worker is not None else None) == expected.worker_id
        if got.worker is not None:
            assert got.cost == expected.cost and got.overlap_blocks == expected.num_overlap_blocks

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
