import dataclasses

import numpy as np
import pytest

from shared.kvcache.overlap import leading_overlap
from shared.planner.config import ConfigError
from shared.policy.admission import (AdmissionConfig, AdmissionInput, Admitter, Inflow, Turnover, fluid_wait_s,
                                    predict_finish_s, predict_ttft_s, slot_wait_s)
from shared.policy.autoscale import AutoscaleConfig, RatioAutoscaler, TickInput
from shared.policy.disagg import DisaggConfig, DisaggInput, decide_prefill
from shared.policy.kv_routing import (RoutingInput, RoutingWeights, WorkerLoadView, choose_worker, route,
                                      route_costs)
from shared.policy.prefill_queue import LevelPicker
from shared.policy.qos import QosConfig, QosTier, load_qos, parse_api_keys
from shared.protocol import WorkerLoad

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

# --- routing ---------------------------------------------------------------------------------------


def _route(active, waiting, overlap, n=64, eligible=None, w=RoutingWeights()):
    return route(RoutingInput(0.0, n, overlap, np.array(active, float), np.array(waiting, float), eligible), w)


def test_routing_trades_overlap_against_load():
    inp = RoutingInput(0.0, 64, {2: 60}, np.array([100.0, 10.0, 50.0]), np.zeros(3))
    # overlap_weight·(64 - overlap) + active + 64: 228, 138, 118 -> worker 2 (its cache saves more)
    assert list(route_costs(inp)) == [228.0, 138.0, 118.0]
    assert route(inp).worker == 2 and route(inp).overlap_blocks == 60
    assert route(inp, RoutingWeights(overlap_weight=0.1)).worker == 1


def test_routing_queue_limit_eligibility_and_ties():
    assert _route([5, 5, 5], [0, 0, 0], {}).worker == 0
    assert _route([5, 5, 5], [32, 0, 0], {}).worker == 1                 # at the queue limit
    assert _route([5, 5, 5], [0, 0, 0], {}, eligible=np.array([False, True, True])).worker == 1
    assert _route([5, 5, 5], [32, 32, 32], {}).worker is None
    # equal cost: fewer active blocks wins (worker 1: 4 + 4·waiting 1 = worker 0: 8)
    assert _route([8, 4], [0, 1], {}, w=RoutingWeights(queue_weight=4.0)).worker == 1


def test_views_route_by_id_and_unreported_admissions_steer_but_never_exclude():
    # ids out of order: the view form sorts them, so an exact tie goes to the lower id
    views = [WorkerLoadView("w2", 5, 0), WorkerLoadView("w1", 5, 0)]
    assert choose_worker(views, {}, 4).worker_id == "w1"
    # hand-computed: w1 = 1·(4-0) + 5 + 4 + 4·(0+2) = 21, w2 = 1·(4-2) + 5 + 4 + 0 = 11
    views = [WorkerLoadView("w1", 5, 0, num_admitted_unreported=2), WorkerLoadView("w2", 5, 0)]
    choice = choose_worker(views, {"w2": 2, "gone": 4}, 4)
    assert (choice.worker_id, choice.cost, choice.num_overlap_blocks) == ("w2", 11.0, 2)
    # the queue limit reads the reported queue only: 40 unreported admissions do not exclude w1
    limit = RoutingWeights(max_waiting_per_worker=1)
    assert choose_worker([WorkerLoadView("w1", 0, 0, num_admitted_unreported=40)], {}, 4, limit).worker_id == "w1"
    assert choose_worker([WorkerLoadView("w1", 0, 1)], {}, 4, limit).worker_id is None

# --- the prefix walk --------------------------------------------------------------------------------


def test_leading_overlap_counts_unbroken_runs_from_the_first_block():
    blocks = [{"a", "b"}, {"a", "b"}, {"b", "c"}, {"a", "b", "c"}, set(), {"a"}]
    # a: blocks 0-1 (misses 2); b: 0-3; c never held block 0; the empty block 4 ends the walk
    assert leading_overlap(blocks) == {"a": 2, "b": 4}
    assert leading_overlap([]) == {} and leading_overlap([set(), {"a"}]) == {}

    def lazily():
        yield {"a"}
        yield set()
        raise AssertionError("the walk reads past the first block nobody holds")

    assert leading_overlap(lazily()) == {"a": 1}

# --- QoS configuration ------------------------------------------------------------------------------


def test_qos_file_the_issue_shape_loads(tmp_path):
    path = tmp_path / "qos.yaml"
    path.write_text("default_tier: standard\ntiers:\n"
                    "  premium:  {priority: 0, ttft_slo_ms: 1500, itl_slo_ms: 200}\n"
                    "  standard: {priority: 1, ttft_slo_ms: 5000}\n"
                    "  batch:    {priority: 2, ttft_slo_ms: 30000, max_queued: 200}\n")
    qos = load_qos(path)
    assert qos.tier(None).priority == 1 and qos.tier("premium").ttft_slo_s == 1.5
    assert qos.tier("batch").max_queued == 200 and qos.tier("standard").itl_slo_s is None
    assert qos.resolve("premium") == "premium" and qos.resolve("gold") == qos.resolve(None) == "standard"
    assert load_qos(None) == QosConfig.single() and QosConfig.single().tier(None).ttft_slo_s is None
    assert parse_api_keys("k1:premium, k2", qos) == {"k1": "premium", "k2": "standard"}


@pytest.mark.parametrize("text,field", [
    ("tiers: {a: {priority: 0}}", "default_tier: Field required"),
    ("default_tier: b\ntiers: {a: {priority: 0}}", "default_tier 'b' is not one of the tiers ['a']"),
    ("default_tier: a\ntiers: {a: {priority: -1}}", "tiers.a.priority"),
    ("default_tier: a\ntiers: {a: {priority: 0, ttft_slo: 5}}", "tiers.a.ttft_slo"),
    ("default_tier: a\ntiers: {}", "tiers"),
    ("default_tier: [a", "not valid YAML"),
])
def test_a_bad_qos_file_is_one_line_naming_the_field(tmp_path, text, field):
    path = tmp_path / "qos.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_qos(path)
    message = str(info.value)
    assert field in message and "\n" not in message and str(path) in message


def test_an_unknown_tier_in_api_keys_is_named():
    with pytest.raises(ConfigError, match="key 'k1' names tier 'gold', not one of \\['default'\\]"):
        parse_api_keys("k1:gold", QosConfig.single())

# --- admission ------------------------------------------------------------------------------------

QOS = QosConfig(default_tier="standard", tiers={
    "premium": QosTier(priority=0, ttft_slo_ms=2000), "standard": QosTier(priority=1, ttft_slo_ms=1000),
    "batch": QosTier(priority=2, ttft_slo_ms=500, max_queued=1000)})


def _adm(tier="standard", queued=0.0, prompt=1000, cached=0, queued_requests=0, wait=0.0, now=0.0, rate=10_000.0):
    return AdmissionInput(now_s=now, tier=tier, prompt_tokens=prompt, cached_tokens=cached,
                          queued_prefill_tokens=queued, prefill_tokens_per_s=rate,
                          queued_requests=queued_requests, transfer_s=0.05, decode_wait_s=wait)


def test_predicted_ttft_is_backlog_over_rate():
    assert predict_ttft_s(_adm(queued=9000, prompt=1000)) == pytest.approx(1.0 + 0.05)
    assert predict_ttft_s(_adm(queued=0, prompt=1000, cached=500, wait=0.5)) == pytest.approx(0.05 + 0.05 + 0.5)
    assert predict_ttft_s(_adm(rate=None)) is None   # nothing measured yet: no prediction


def test_higher_priority_work_arriving_meanwhile_slows_the_prediction():
    # 9000 queued + 1000 own at 10,000 tok/s, of which 6,000 tok/s go to a higher tier arriving
    # meanwhile: served at 4,000 tok/s, 2.5 s + 0.05 s transfer
    inp = dataclasses.replace(_adm(queued=9000, prompt=1000), preempting_tokens_per_s=6000.0)
    assert predict_ttft_s(inp) == pytest.approx(2.5 + 0.05)
    saturated = dataclasses.replace(inp, preempting_tokens_per_s=10_000.0)
    assert predict_ttft_s(saturated) == float("inf")
    d = Admitter(AdmissionConfig(QOS, min_retry_after_s=1.0)).decide(saturated)
    assert not d.admitted and d.code == "slo" and d.retry_after_s == 1.0


def test_a_prompts_own_prefill_time_on_one_worker_replaces_its_share_of_the_pools_rate():
    # a pool of 10,000 tok/s (ten workers of 1,000): 9,000 tokens ahead drain in 0.9 s, but this
    # prompt's own 1,000 tokens run on one worker and take its 1.0 s, not 0.1 s
    inp = dataclasses.replace(_adm(tier="premium", queued=9000, prompt=1000), own_prefill_s=1.0)
    assert predict_ttft_s(inp) == pytest.approx(0.9 + 1.0 + 0.05)
    assert Admitter(AdmissionConfig(QOS)).decide(inp).admitted      # 1.95 s < premium's 2 s


def test_a_prompt_whose_own_prefill_exceeds_its_slo_is_too_long_and_sheds_no_other_tier():
    admitter = Admitter(AdmissionConfig(QOS, min_retry_after_s=1.0))
    # an idle cluster, but the premium prompt alone takes 2.5 s on the worker that would run it
    alone = dataclasses.replace(_adm(tier="premium", prompt=100_000), own_prefill_s=2.5)
    d = admitter.decide(alone)
    assert not d.admitted and d.code == "prompt_too_long" and "alone takes 2.50s > premium SLO 2.00s" in d.reason
    # no load shedding can make it fit, so a lower tier is not shed for it (an SLO miss would shed it)
    assert admitter.decide(_adm(tier="batch", prompt=100)).admitted
    assert admitter.decide(dataclasses.replace(alone, own_prefill_s=1.5)).admitted


def test_without_its_own_prefill_time_a_prompt_is_too_long_when_its_tokens_take_longer_at_the_workers_rate():
    admitter = Admitter(AdmissionConfig(QOS, min_retry_after_s=1.0))
    # the admission service passes the worker's measured (one-worker) rate, no own_prefill_s:
    # 15,000 uncached tokens at 10,000 tok/s take 1.5 s alone, over standard's 1 s SLO
    d = admitter.decide(_adm(prompt=20_000, cached=5_000))
    assert (d.admitted, d.code, d.worker_bound) == (False, "prompt_too_long", True)
    assert "alone takes 1.50s > standard SLO 1.00s" in d.reason
    assert admitter.decide(_adm(tier="batch", prompt=100)).admitted   # nothing shed for it
    assert admitter.decide(_adm(prompt=20_000, cached=15_000)).admitted     # 0.5 s alone: fits
    assert admitter.decide(_adm(prompt=20_000, rate=None)).admitted        # no rate: no prediction


def test_inflow_is_tokens_per_second_above_a_priority_over_the_window():
    inflow = Inflow(window_s=10.0)
    inflow.note("w1", 0.0, 0, 3000.0)
    inflow.note("w1", 5.0, 1, 2000.0)
    inflow.note("w1", 6.0, 2, 9000.0)
    inflow.note("w2", 6.0, 0, 7000.0)
    # w1 has been watched for 6 s of the 10 s window: its rates are over those 6 s
    assert inflow.tokens_per_s_above("w1", 0, 6.0) == 0.0             # nothing above the top tier
    assert inflow.tokens_per_s_above("w1", 1, 6.0) == pytest.approx(500.0)
    assert inflow.tokens_per_s_above("w1", 2, 6.0) == pytest.approx(5000.0 / 6)
    assert inflow.requests_per_s_by_priority_above("w1", 2, 6.0) == pytest.approx({0: 1 / 6, 1: 1 / 6})
    assert inflow.tokens_per_s_above("w1", 2, 10.5) == pytest.approx(200.0)   # the one at 0 s has left the window
    assert inflow.requests_per_s_above("w1", 2, 10.5) == pytest.approx(0.1)
    assert inflow.requests_per_s_by_priority_above("w1", 2, 10.5) == pytest.approx({1: 0.1})
    assert inflow.requests_per_s_above("w2", 1, 10.5) == pytest.approx(1 / 4.5)  # watched for 4.5 s
    assert inflow.requests_per_s_above("w2", 1, 30.0) == 0.0
    assert inflow.tokens_per_s_above("w3", 2, 6.0) == 0.0
    assert inflow.requests_per_s_by_priority_above("w3", 2, 6.0) == {}
    inflow.forget({"w1"})
    assert inflow.tokens_per_s_above("w2", 1, 6.0) == 0.0


def test_a_burst_at_the_start_is_not_diluted_by_the_window():
    inflow = Inflow(window_s=10.0, min_span_s=1.0)
    for t in (100.0, 100.1, 100.2):               # three premium requests, the first ones seen
        inflow.note("w1", t, 0, 100.0)
    assert inflow.requests_per_s_above("w1", 2, 100.3) == pytest.approx(3.0)  # at least 1 s: not 30/s
    for k in range(9):                            # and they keep coming at 3 per second
        inflow.note("w1", 100.3 + k / 3, 0, 100.0)
    assert inflow.requests_per_s_above("w1", 2, 103.0) == pytest.approx(12 / 3.0)
    for k in range(9, 30):
        inflow.note("w1", 100.3 + k / 3, 0, 100.0)
    assert inflow.requests_per_s_above("w1", 2, 110.2) == pytest.approx(3.0, abs=0.15)
    # a first request after the key has been watched for a window counts over the whole window
    inflow.note("w2", 0.0, 2, 100.0)
    inflow.note("w2", 50.0, 0, 100.0)
    assert inflow.requests_per_s_above("w2", 2, 50.1) == pytest.approx(0.1)


def test_slot_wait_when_the_batch_is_full():
    # 8 slots full, 3 ahead + itself, 40 tokens at 25 ms each: 4 · 1.0 s / 8 = 0.5 s
    assert slot_wait_s(num_running=8, max_num_seqs=8, num_waiting_ahead=3, mean_output_tokens=40,
                       itl_s=0.025) == pytest.approx(0.5)
    # one slot free: the first of the 3 ahead takes it, the other 2 and itself wait: 3 / 8 s
    assert slot_wait_s(num_running=7, max_num_seqs=8, num_waiting_ahead=3, mean_output_tokens=40,
                       itl_s=0.025) == pytest.approx(0.375)
    assert slot_wait_s(num_running=4, max_num_seqs=8, num_waiting_ahead=3, mean_output_tokens=40, itl_s=0.025) == 0
    assert slot_wait_s(num_running=8, max_num_seqs=8, num_waiting_ahead=3, mean_output_tokens=40, itl_s=None) == 0
    # slots free at 8 per second; higher-priority requests arriving at 6/s take them first: 4 / 2 = 2 s
    assert slot_wait_s(num_running=8, max_num_seqs=8, num_waiting_ahead=3, mean_output_tokens=40, itl_s=0.025,
                       preempting_requests_per_s=6.0) == pytest.approx(2.0)
    assert slot_wait_s(num_running=8, max_num_seqs=8, num_waiting_ahead=3, mean_output_tokens=40, itl_s=0.025,
                       preempting_requests_per_s=8.0) == float("inf")


def test_short_higher_priority_answers_hold_the_slots_they_take_only_briefly():
    # one slot, held by a request of a 200-token mean at 25 ms a token: a slot frees every 5 s.
    # Premium arrives at 0.3/s. Counted as a whole slot each, 0.3/s > 0.2/s frees: never starts.
    assert slot_wait_s(num_running=1, max_num_seqs=1, num_waiting_ahead=0, mean_output_tokens=200,
                       itl_s=0.025, preempting_requests_per_s=0.3) == float("inf")
    # premium answers are 8 tokens: they keep 0.3 x 8 x 0.025 = 0.06 of the slot busy, the other
    # 0.94 turns over every 5 s: 1 / (0.94 / 5) = 5.32 s
    assert slot_wait_s(num_running=1, max_num_seqs=1, num_waiting_ahead=0, mean_output_tokens=200,
                       itl_s=0.025, preempting_requests_per_s=0.3,
                       preempting_output_tokens=8) == pytest.approx(5 / 0.94)
    # long premium answers make the wait longer than counting them as the mean does
    assert slot_wait_s(num_running=8, max_num_seqs=8, num_waiting_ahead=3, mean_output_tokens=40, itl_s=0.025,
                       preempting_requests_per_s=4.0, preempting_output_tokens=40) == pytest.approx(1.0)
    assert slot_wait_s(num_running=8, max_num_seqs=8, num_waiting_ahead=3, mean_output_tokens=40, itl_s=0.025,
                       preempting_requests_per_s=4.0, preempting_output_tokens=60) == pytest.approx(2.0)
    assert slot_wait_s(num_running=8, max_num_seqs=8, num_waiting_ahead=3, mean_output_tokens=40, itl_s=0.025,
                       preempting_requests_per_s=4.0, preempting_output_tokens=80) == float("inf")


def test_rows_left_out_of_higher_priority_prefill_steps_hold_their_slots_longer():
    # 8 slots turning over each second (40 tokens at 25 ms); premium prompts take 60% of the
    # worker's time in prefill steps that leave these rows out: they decode in the other 40%, so
    # a slot frees every 1 / (8 x 0.4) s and 4 to free take 1.25 s, not 0.5 s
    kw = dict(num_running=8, max_num_seqs=8, num_waiting_ahead=3, mean_output_tokens=40, itl_s=0.025)
    assert slot_wait_s(**kw, paused_share=0.6) == pytest.approx(4 / (8 * 0.4))
    assert slot_wait_s(**kw, paused_share=0.0) == pytest.approx(0.5)
    assert slot_wait_s(**kw, paused_share=1.0) == float("inf")   # prefill above takes every step
    assert slot_wait_s(**kw, paused_share=1.5) == float("inf")   # more than the whole time: every step too
    assert slot_wait_s(**kw, preempting_requests_per_s=10.0, paused_share=1.5) == float("inf")
    # with the premium answers' own slots too: (8 - 6 x 40 x 0.025) x 0.5 / 1 s = 1 free a second
    assert slot_wait_s(**kw, preempting_requests_per_s=6.0, paused_share=0.5) == pytest.approx(4.0)
    # once the turnover is measured, the pauses are in it
    assert slot_wait_s(**kw, measured_frees_per_s=3.0, paused_share=0.6) == pytest.approx(4 / 3)


def test_the_wait_counts_the_spread_of_the_arrivals_above_it():
    # no margin: the mean alone, work / rate left
    assert fluid_wait_s(4.0, 2.0, 4.0, 1.0, 0.0) == pytest.approx(2.0)
    assert fluid_wait_s(4.0, 2.0) == pytest.approx(2.0)
    # one standard deviation: W * 2 = 4 + sqrt(4 W), so sqrt(W) = 2 and W = 4
    assert fluid_wait_s(4.0, 2.0, 4.0, 1.0, 1.0) == pytest.approx(4.0)
    assert fluid_wait_s(4.0, 0.0, 4.0, 1.0, 1.0) == float("inf")
    assert fluid_wait_s(0.0, 2.0, 4.0, 1.0, 1.0) == pytest.approx(1.0)  # arrivals alone: 2 W = 2 sqrt(W)
    # a rate measured over 2 s, not known exactly: the count's variance over W is 4 W + 4 W^2 / 2
    wide = fluid_wait_s(4.0, 2.0, 4.0, 1.0, 1.0, watched_s=2.0)
    assert 2 * wide == pytest.approx(4 + (4 * wide + 4 * wide ** 2 / 2) ** 0.5)
    assert wide > 4.0
    # the longer the rate was watched, the nearer a known rate's wait
    assert fluid_wait_s(4.0, 2.0, 4.0, 1.0, 1.0, watched_s=1e9) == pytest.approx(4.0)
    assert fluid_wait_s(4.0, 2.0, 4.0, 1.0, 1.0, watched_s=10.0) < wide
    # its uncertainty alone grows as fast as the rate left (1 x sqrt(4 / 1) = 2): no bound
    assert fluid_wait_s(4.0, 2.0, 4.0, 1.0, 1.0, watched_s=1.0) == float("inf")
    # the slot wait: slots free for it at 2/s (8 slots, 40 tokens at 25 ms, 6/s above of the same
    # length); 4 to free, plus 1.645 sd of the arrivals over the wait: 2 W = 4 + 1.645 sqrt(6 W)
    wait = slot_wait_s(num_running=8, max_num_seqs=8, num_waiting_ahead=3, mean_output_tokens=40, itl_s=0.025,
                       preempting_requests_per_s=6.0, margin_sd=1.645)
    assert 2 * wait == pytest.approx(4 + 1.645 * (6 * wait) ** 0.5)
    assert wait > 2.0
    # half-length answers above cost half as many turnovers each
    short = slot_wait_s(num_running=8, max_num_seqs=8, num_waiting_ahead=3, mean_output_tokens=40, itl_s=0.025,
                        preempting_requests_per_s=6.0, preempting_output_tokens=20, margin_sd=1.645)
    rate_left = (8 - 6 * 20 * 0.025) / (40 * 0.025)
    assert short * rate_left == pytest.approx(4 + 1.645 * 0.5 * (6 * short) ** 0.5)
    # the prefill wait: 9000 + 1000 tokens at 4000 tok/s left, the 6000 tok/s above in 20
    # requests a second (300 tokens each): 4000 W = 10000 + 1.645 * 300 * sqrt(20 W)
    inp = dataclasses.replace(_adm(queued=9000, prompt=1000), preempting_tokens_per_s=6000.0,
                              preempting_requests_per_s=20.0)
    assert predict_ttft_s(inp) == pytest.approx(2.5 + 0.05)  # no margin asked for
    ttft = predict_ttft_s(inp, 1.645)
    assert 4000 * (ttft - 0.05) == pytest.approx(10000 + 1.645 * 300 * (20 * (ttft - 0.05)) ** 0.5)
    # the Admitter counts the margin from its config (default 1.645): 2.5 s mean, ~2.8 s with it
    assert Admitter(AdmissionConfig(QOS)).decide(inp).predicted_ttft_s == pytest.approx(ttft)
    assert Admitter(AdmissionConfig(QOS, arrival_margin_sd=0)).decide(inp).predicted_ttft_s == pytest.approx(2.55)


def test_slots_free_at_the_rate_measured_while_the_worker_had_none_to_spare():
    turnover = Turnover(window_s=10.0, min_span_s=2.0, min_ended=3)
    turnover.note("w1", 0.0, 10, True)
    turnover.note("w1", 1.0, 14, True)          # 4 ended in 1 s, saturated at both ends
    assert turnover.frees_per_s("w1", 1.0) is None   # 1 s seen: not yet
    turnover.note("w1", 2.0, 16, False)         # a slot to spare at the end: not counted
    turnover.note("w1", 3.0, 17, True)          # nor from a report that had one
    turnover.note("w1", 4.5, 20, True)          # 3 more in 1.5 s
    assert turnover.frees_per_s("w1", 4.5) == pytest.approx(7 / 2.5)
    assert turnover.frees_per_s("w1", 10.5) == pytest.approx(7 / 2.5)
    assert turnover.frees_per_s("w1", 11.2) is None  # the span ending at 1 s left the window: 1.5 s seen
    assert turnover.frees_per_s("w1", 30.0) is None  # all of it older than the window
    turnover.note("w2", 0.0, 5, True)
    turnover.note("w2", 3.0, 6, True)           # one long answer ended in 3 s: too few to say
    assert turnover.frees_per_s("w2", 3.0) is None
    turnover.forget({"w1"})
    assert turnover.frees_per_s("w2", 3.0) is None
    # the measured rate replaces the one from output lengths: 4 to free at 3/s less 1/s above
    # (which takes one freed slot each): 2 s; with the arrivals' spread, longer
    kw = dict(num_running=8, max_num_seqs=8, num_waiting_ahead=3, mean_output_tokens=40, itl_s=0.025,
              preempting_requests_per_s=1.0)
    assert slot_wait_s(**kw) == pytest.approx(4 / ((8 - 1.0) / 1.0))      # 8 slots turning over each second
    assert slot_wait_s(**kw, measured_frees_per_s=3.0) == pytest.approx(2.0)
    wait = slot_wait_s(**kw, measured_frees_per_s=3.0, margin_sd=1.645)
    assert 2 * wait == pytest.approx(4 + 1.645 * wait ** 0.5)
    assert slot_wait_s(**kw, measured_frees_per_s=1.0) == float("inf")    # the higher tier takes every free
    assert slot_wait_s(**{**kw, "num_running": 4}, measured_frees_per_s=1.0) == 0.0  # a slot for it now


def test_early_rejection_against_slo_with_retry_after():
    admitter = Admitter(AdmissionConfig(QOS, min_retry_after_s=1.0))
    assert admitter.decide(_adm(queued=5000)).admitted
    d = admitter.decide(_adm(queued=30_000))   # (30000 + 1000) / 10000 + 0.05 = 3.15 s against 1 s: retry in 2.15 s
    assert not d.admitted and d.code == "slo" and d.retry_after_s == pytest.approx(2.15)
    assert "predicted TTFT 3.15s > standard SLO 1.00s" in d.reason
    assert admitter.decide(_adm(queued=30_000, rate=None)).admitted   # no rate: admitted


def test_a_higher_tier_is_never_rejected_while_a_lower_one_is_admitted():
    admitter = Admitter(AdmissionConfig(QOS, shed_hold_s=2.0, min_retry_after_s=0.5))
    assert admitter.decide(_adm("batch", queued=2000, now=0.0)).admitted          # 0.35 s < 0.5 s
    miss = admitter.decide(_adm("standard", queued=12_000, now=1.0))             # 1.35 s > 1 s
    assert not miss.admitted and miss.code == "slo"
    shed = admitter.decide(_adm("batch", queued=0, now=2.0))                      # would fit, but shed
    assert not shed.admitted and shed.code == "shedding" and shed.retry_after_s == pytest.approx(1.0)
    assert admitter.decide(_adm("premium", queued=12_000, now=2.0)).admitted      # a higher tier still goes
    assert admitter.decide(_adm("batch", queued=0, now=3.01)).admitted            # the hold is over


def test_a_request_predicted_to_miss_on_the_routings_choice_is_admitted_on_the_next_worker_that_meets_it():
    admitter = Admitter(AdmissionConfig(QOS, shed_hold_s=2.0, min_retry_after_s=0.5))
    seen = []

    def observed(*queues, tier="standard", now=0.0):  # one input per candidate worker, consumed lazily
        for q in queues:
            seen.append(q)
            yield _adm(tier, queued=q, now=now)

    # 12,000 tokens ahead on the holder (1.35 s > 1 s), 2,000 on the next: admitted there
    k, d = admitter.decide_first(observed(12_000, 2_000, 0))
    assert (k, d.admitted) == (1, True) and d.predicted_ttft_s == pytest.approx(0.35)
    assert seen == [12_000, 2_000]                     # the third worker was never observed
    assert admitter.decide(_adm("batch", queued=0, now=0.5)).admitted   # no miss remembered: nothing shed
    assert admitter.decide_first(observed(0))[1].admitted
    # every candidate misses: the first one's rejection, and only now are the lower tiers shed
    k, d = admitter.decide_first(observed(12_000, 20_000, now=1.0))
    assert (k, d.admitted, d.code, d.worker_bound) == (0, False, "slo", True)
    assert "predicted TTFT 1.35s" in d.reason
    shed = admitter.decide_first(observed(0, tier="batch", now=1.5))[1]
    assert shed.code == "shedding" and not shed.worker_bound
    # a rejection that is the same on every worker stops the search at the first candidate
    seen.clear()
    d = admitter.decide_first(observed(0, 0, tier="batch", now=1.6))[1]
    assert d.code == "shedding" and seen == [0]
    with pytest.raises(ValueError, match="no candidate"):
        admitter.decide_first(iter(()))


def test_next_cheapest_ranks_the_other_usable_workers_by_cost():
    from shared.policy.kv_routing import next_cheapest, next_cheapest_workers
    inp = RoutingInput(0.0, 10, {0: 10}, np.array([5.0, 0.0, 20.0, 0.0]), np.array([0.0, 0.0, 0.0, 32.0]))
    best = route(inp)
    assert (best.worker, best.cost) == (0, 15.0)                  # the holder: nothing to prefill
    rest = next_cheapest(inp, best.worker)
    assert [(d.worker, d.cost) for d in rest] == [(1, 20.0), (2, 40.0)]   # worker 3 is at its queue limit
    assert next_cheapest(inp, best.worker, limit=1) == rest[:1]
    views = [WorkerLoadView("a", 5, 0), WorkerLoadView("b", 0, 0), WorkerLoadView("c", 20, 0)]
    first = choose_worker(views, {"a": 10}, 10)
    rest = next_cheapest_workers(views, {"a": 10}, 10, first.worker_id)
    ranked = [first, *rest]
    assert [(c.worker_id, c.num_overlap_blocks) for c in ranked] == [("a", 10), ("b", 0), ("c", 0)]
    assert next_cheapest_workers(views, {"a": 10}, 10, first.worker_id, limit=0) == []
    assert next_cheapest_workers([*views, WorkerLoadView("d", 0, 32)], {"a": 10}, 10, "a") == rest  # d is full
    assert choose_worker([WorkerLoadView("a", 0, 32)], {}, 10).worker_id is None   # none usable


def test_tier_queue_limit_unknown_tier_and_too_long_prompts():
    admitter = Admitter(AdmissionConfig(QOS, max_prompt_tokens=131_072))
    d = admitter.decide(_adm(tier="batch", queued_requests=1_000))
    assert not d.admitted and d.code == "tier_queue_full"
    assert admitter.decide(_adm(tier="batch", queued_requests=999)).admitted
    with pytest.raises(ValueError, match="unknown tier"):
        admitter.decide(_adm(tier="gold"))
    d = admitter.decide(_adm(prompt=200_000))
    assert not d.admitted and d.code == "prompt_too_long" and d.retry_after_s == 0

def test_lower_tiers_are_shed_before_their_batch_pushes_a_higher_tiers_itl_over_its_budget():
    qos = QosConfig(default_tier="batch", tiers={
        "premium": QosTier(priority=0, ttft_slo_ms=2000, itl_slo_ms=200), "batch": QosTier(priority=2)})
    admitter = Admitter(AdmissionConfig(qos))

    def on_worker(tier, itl_s, num_running):
        return admitter.decide(dataclasses.replace(_adm(tier), itl_s=itl_s, num_running=num_running))

    assert on_worker("batch", 0.150, 3).admitted                     # 150 ms · 4/3 = 200 ms: within
    shed = on_worker("batch", 0.180, 4)                              # 180 ms · 5/4 = 225 ms > 200 ms
    assert not shed.admitted and shed.code == "shedding" and "225ms, over the 200ms budget" in shed.reason
    assert on_worker("premium", 0.180, 4).admitted                   # the budget holds back lower tiers only
    assert on_worker("batch", None, 4).admitted                      # no ITL measured yet


def test_a_full_batch_of_lower_priority_does_not_delay_a_higher_tier():
    load = WorkerLoad(worker_id="d", role="decode", seq=1, timestamp=0.0, num_running=8,
                      num_running_by_priority={0: 2, 2: 6}, num_waiting_by_priority={2: 5})
    assert (load.num_running_ahead(0), load.num_running_ahead(2)) == (2, 8)
    assert (load.num_waiting_ahead(0), load.num_waiting_ahead(2)) == (0, 5)
    older = WorkerLoad(worker_id="d", role="decode", seq=1, timestamp=0.0, num_running=8)  # reports no split
    assert older.num_running_ahead(0) == 8


# --- prefill queue order -----------------------------------------------------------------------------


def test_the_prefill_queue_serves_by_priority_and_a_waiting_lower_level_every_fourth_pick():
    picker = LevelPicker(3, max_skips=3)
    pending = [5, 0, 2]
    picks = []
    while (level := picker.pick(pending)) is not None:
        picks.append(level)
        pending[level] -= 1
    # level 2 is passed over three times, then served; then level 0 again, ...
    assert picks == [0, 0, 0, 2, 0, 0, 2]
    assert LevelPicker(3).pick([0, 0, 0]) is None
    # no contention: plain priority, and a level with nothing waiting collects no skips
    picker = LevelPicker(3, max_skips=1)
    assert [picker.pick(p) for p in ([1, 0, 0], [1, 0, 0], [0, 1, 1])] == [0, 0, 1]
    assert picker.pick([0, 0, 1]) == 2

# --- autoscaling ----------------------------------------------------------------------------------


def _tick(now, num_p, num_d, p_demand, d_demand):
    return TickInput(now_s=now, num_prefill=num_p, num_decode=num_d, prefill_tokens_per_s=p_demand,
                     decode_tokens_per_s=d_demand, prefill_capacity_tokens_per_s=10_000,
                     decode_capacity_tokens_per_s=1_000)


def test_autoscaler_moves_workers_toward_the_demand_ratio():
    scaler = RatioAutoscaler(AutoscaleConfig(cooldown_s=60, stabilization_s=0, max_flips_per_tick=8))
    # prefill needs 6 workers, decode 2 -> of 8 workers, 6 should prefill
    d = scaler.tick(_tick(0.0, 2, 6, 60_000, 2_000))
    assert (d.target_prefill, d.target_decode, d.flips) == (6, 2, 4)


def test_autoscaler_cooldown_hysteresis_and_minimums():
    scaler = RatioAutoscaler(AutoscaleConfig(cooldown_s=60, stabilization_s=0, hysteresis=0.15,
                                             max_flips_per_tick=8))
    assert scaler.tick(_tick(0.0, 2, 6, 60_000, 2_000)).flips == 4
    assert scaler.tick(_tick(30.0, 6, 2, 10_000, 7_000)).flips == 0       # cooling down
    assert scaler.tick(_tick(61.0, 4, 4, 41_000, 4_000)).flips == 0       # within hysteresis
    d = scaler.tick(_tick(200.0, 4, 4, 0, 8_000))                         # all decode demand
    assert d.target_prefill == 1 and d.target_decode == 7                 # min_prefill kept
    assert RatioAutoscaler().tick(_tick(0.0, 4, 4, 0, 0)).flips == 0      # no load, no change


def test_a_flip_that_leaves_the_busier_side_as_busy_is_not_made():
    # 3 prefill + 2 decode, demand 2.5 workers of each: the share (0.5 against 0.6) asks for 2 + 3,
    # but the busier side would carry 1.25 workers' worth per worker either way
    scaler = RatioAutoscaler(AutoscaleConfig(cooldown_s=0, stabilization_s=0))
    d = scaler.tick(_tick(0.0, 3, 2, 25_000, 2_500))
    assert d.flips == 0 and d.reason.startswith("no gain")
    # decode demand up to 3.5 workers: 2 + 3 brings the busier side from 1.75 to 1.25 per worker
    assert scaler.tick(_tick(1.0, 3, 2, 25_000, 3_500)).flips == -1


def test_a_change_is_made_only_once_every_tick_of_the_stabilization_window_asked_for_it():
    scaler = RatioAutoscaler(AutoscaleConfig(cooldown_s=0, stabilization_s=30, min_prefill=0, max_flips_per_tick=8))
    prefill_heavy = (60_000, 2_000)                                       # asks for 6 of 8 prefilling
    assert scaler.tick(_tick(0.0, 2, 6, *prefill_heavy)).flips == 0
    assert scaler.tick(_tick(10.0, 2, 6, 20_000, 6_000)).flips == 0      # balanced: the run breaks
    for now in (20.0, 30.0, 40.0):
        d = scaler.tick(_tick(now, 2, 6, *prefill_heavy))
        assert d.flips == 0 and "asked for" in d.reason, d
    # a tick asking the other way (every worker to decode) breaks the run too
    d = scaler.tick(_tick(45.0, 2, 6, 0, 8_000))
    assert d.flips == 0 and "wanted" in d.reason, d
    for now in (50.0, 60.0, 70.0):
        assert scaler.tick(_tick(now, 2, 6, *prefill_heavy)).flips == 0
    # 30 s of asks, the smallest of them made: 3 prefill workers wanted once, 6 the other times
    assert scaler.tick(_tick(75.0, 2, 6, 30_000, 4_000)).flips == 0
    d = scaler.tick(_tick(80.0, 2, 6, *prefill_heavy))
    assert (d.target_prefill, d.target_decode, d.flips) == (3, 5, 1)
    # a change in progress voids the asks before it
    scaler.hold(200.0)
    assert scaler.tick(_tick(200.0, 3, 5, *prefill_heavy)).flips == 0
    assert scaler.tick(_tick(230.0, 3, 5, *prefill_heavy)).flips == 3


def test_a_request_predicted_to_finish_after_its_deadline_is_rejected_without_shedding_others():
    admitter = Admitter(AdmissionConfig(QOS, min_retry_after_s=1.0))
    # TTFT 0.15 s (1000 tokens at 10,000 tok/s + transfer), then 99 more tokens at 20 ms (ITL 10 ms
    # with 1 running, 2 with this one): finishes at 2.13 s
    base = dataclasses.replace(_adm(tier="premium"), itl_s=0.010, num_running=1, max_output_tokens=100)
    assert predict_finish_s(base, predict_ttft_s(base)) == pytest.approx(0.15 + 99 * 0.020)
    assert admitter.decide(dataclasses.replace(base, deadline_s=3.0)).admitted
    late = admitter.decide(dataclasses.replace(base, deadline_s=1.0))
    assert not late.admitted and late.code == "deadline" and "deadline" in late.reason
    assert late.retry_after_s == pytest.approx(2.13 - 1.0)
    assert not admitter.decide(dataclasses.replace(base, deadline_s=0.0)).admitted  # already passed
    # the miss is the request's own: lower tiers are not shed for it (an SLO miss would shed them)
    assert admitter.decide(_adm(tier="batch", prompt=100)).admitted
    # nothing measured yet: no prediction, admitted while the deadline has not passed
    unmeasured = dataclasses.replace(base, prefill_tokens_per_s=None, deadline_s=0.5)
    assert admitter.decide(unmeasured).admitted
    assert admitter.decide(dataclasses.replace(base, itl_s=None, deadline_s=0.5)).admitted
