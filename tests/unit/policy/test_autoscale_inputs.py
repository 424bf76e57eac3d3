"""The autoscaler's observations → TickInput adapter and the choice of workers to flip."""

import pytest

from shared.policy.autoscale import AutoscaleConfig, RatioAutoscaler, ScalingDecision
from shared.policy.autoscale_inputs import (Capacities, Demand, Flip, WorkerSample, choose_flips, in_transition,
                                            measure_demand, tick_input)

DEFAULTS = Capacities(prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0)


def sample(worker_id, role="decode", t=0.0, prompt=0, cached=0, generated=0, queued=0, ready=True, in_flight=0,
           rate=None, local_only=0):
    return WorkerSample(worker_id=worker_id, role=role, is_ready=ready, timestamp=t, num_prompt_tokens=prompt,
                        num_cached_prompt_tokens=cached, num_generated_tokens=generated,
                        num_queued_prefill_tokens=queued, num_in_flight=in_flight, prefill_tokens_per_s=rate,
                        num_local_only_prompt_tokens=local_only)


def by_id(*samples):
    return {s.worker_id: s for s in samples}


def test_rates_are_uncached_prompt_tokens_and_decode_output_over_the_interval():
    before = by_id(sample("d1", t=10, prompt=1000, cached=200, generated=500),
                   sample("p1", role="prefill", t=10, prompt=4000, cached=0, generated=10))
    after = [sample("d1", t=12, prompt=1600, cached=600, generated=900),   # 200 uncached, 400 generated
             sample("p1", role="prefill", t=12, prompt=7000, cached=1000, generated=12)]  # 2000 uncached
    demand = measure_demand(before, after)
    assert demand == Demand(prefill_tokens_per_s=(200 + 2000) / 2, decode_tokens_per_s=400 / 2, interval_s=2)


def test_backlog_growth_counts_as_prefill_demand_and_shrinking_does_not_go_negative():
    before = by_id(sample("d1", t=0, prompt=100, queued=500), sample("d2", t=0, prompt=100, queued=0))
    grew = measure_demand(before, [sample("d1", t=1, prompt=100, queued=1500), sample("d2", t=1, prompt=100)])
    assert grew.prefill_tokens_per_s == 1000
    shrank = measure_demand(before, [sample("d1", t=1, prompt=600, queued=0), sample("d2", t=1, prompt=100)])
    assert shrank.prefill_tokens_per_s == 500  # computed 500; the backlog shrinking is not demand


def test_across_a_flip_prompt_tokens_count_as_prefill_work_and_output_tokens_not_as_decode():
    before = by_id(sample("d1", t=0, prompt=100, generated=100))
    flipped = measure_demand(before, [sample("d1", role="prefill", t=2, prompt=900, generated=150)])
    assert flipped == Demand(prefill_tokens_per_s=400.0, decode_tokens_per_s=0.0, interval_s=2)


@pytest.mark.parametrize("after, why", [
    (sample("d1", t=2, prompt=10, generated=0), "counters went back: a restart"),
    (sample("d1", t=0, prompt=900, generated=900), "no time passed"),
    (sample("d9", t=2, prompt=900, generated=900), "seen once"),
])
def test_a_worker_that_cannot_be_compared_contributes_nothing(after, why):
    before = by_id(sample("d1", t=0, prompt=100, generated=100))
    assert measure_demand(before, [after]) == Demand(0.0, 0.0, 0.0), why


def test_a_worker_without_a_report_in_the_earlier_sample_neither_adds_its_totals_nor_stretches_the_interval():
    """The autoscaler once flipped a worker on a quiet stack: one worker registered before its first
    load report, sampled as zeros at timestamp 0; the next sample's warm-up totals over an interval
    from 0 gave both rates ~1e-6 tokens/s, and their ratio asked for a prefill worker."""
    from shared.cluster.scaling import worker_sample
    from shared.protocol import WorkerInfo, WorkerStatus

    info = WorkerInfo(worker_id="d2", role="decode", state="ready", model="m", block_size=16, max_model_len=64,
                      generate_subject="g", cancel_subject="c")
    unreported = worker_sample(WorkerStatus(info=info, load=None))
    assert not unreported.has_report
    before = by_id(sample("d1", t=1000, generated=0), unreported)
    after = [sample("d1", t=1004, generated=400), sample("d2", t=1004, prompt=2100, generated=30)]
    assert measure_demand(before, after) == Demand(prefill_tokens_per_s=0.0, decode_tokens_per_s=100.0, interval_s=4)


def test_the_interval_is_the_longest_any_worker_covered():
    before = by_id(sample("d1", t=0, generated=0), sample("d2", t=3, generated=0))
    demand = measure_demand(before, [sample("d1", t=4, generated=400), sample("d2", t=4, generated=400)])
    assert demand.interval_s == 4 and demand.decode_tokens_per_s == 200


def test_tick_input_counts_ready_workers_and_prefers_measured_prefill_rates():
    samples = [sample("d1", rate=3000.0), sample("d2", ready=False, rate=1000.0), sample("p1", role="prefill"),
               sample("p2", role="prefill", ready=False)]
    inp = tick_input(5.0, Demand(700.0, 50.0, 2.0), samples, DEFAULTS)
    assert (inp.now_s, inp.num_decode, inp.num_prefill) == (5.0, 1, 1)
    assert (inp.prefill_tokens_per_s, inp.decode_tokens_per_s) == (700.0, 50.0)
    assert inp.prefill_capacity_tokens_per_s == 2000.0  # mean of what is measured
    assert inp.decode_capacity_tokens_per_s == 100.0
    unmeasured = tick_input(5.0, Demand(0, 0, 0), [sample("d1")], DEFAULTS)
    assert unmeasured.prefill_capacity_tokens_per_s == 1000.0


def test_a_shift_to_long_prompts_moves_a_decode_worker_to_prefill_and_back():
    """Adapter and policy together, as the autoscaler service runs them."""
    policy = RatioAutoscaler(AutoscaleConfig(cooldown_s=5, stabilization_s=0, min_prefill=0, min_decode=1))
    # short prompts, long outputs: 20 uncached prompt tokens per 64 output tokens
    t0 = by_id(sample("d1", t=0), sample("d2", t=0))
    t1 = [sample("d1", t=2, prompt=40, generated=128), sample("d2", t=2, prompt=40, generated=128)]
    decision = policy.tick(tick_input(2.0, measure_demand(t0, t1), t1, DEFAULTS))
    assert decision.flips == 0 and "balanced" in decision.reason
    # long prompts, two output tokens
    t2 = [sample("d1", t=4, prompt=3040, generated=130, in_flight=3),
          sample("d2", t=4, prompt=3040, generated=130, in_flight=1)]
    decision = policy.tick(tick_input(4.0, measure_demand(by_id(*t1), t2), t2, DEFAULTS))
    assert (decision.flips, decision.target_prefill, decision.target_decode) == (1, 1, 1), decision
    assert choose_flips(decision, t2) == [Flip("d2", "prefill")]  # the one with less to drain
    # back to short prompts once the cooldown is over
    t3 = [sample("d1", t=10, prompt=3080, generated=258), sample("d2", role="prefill", t=10, prompt=3040)]
    t4 = [sample("d1", t=12, prompt=3120, generated=386), sample("d2", role="prefill", t=12, prompt=3040)]
    decision = policy.tick(tick_input(12.0, measure_demand(by_id(*t3), t4), t4, DEFAULTS))
    assert decision.flips == -1 and choose_flips(decision, t4) == [Flip("d2", "decode")]


def test_prompts_too_short_for_a_remote_prefill_count_as_decode_side_work():
    """Decode workers prefill short prompts themselves whatever the split: a prefill worker would
    get none of them, so a flood of short prompts asks for no prefill worker; long ones still do."""
    policy = RatioAutoscaler(AutoscaleConfig(cooldown_s=0, stabilization_s=0, min_prefill=0, min_decode=1))
    t0 = by_id(sample("d1", t=0), sample("d2", t=0))
    # 3,000 uncached prompt tokens a second against 130 output tokens: prefill-heavy, all of it short prompts
    short = [sample("d1", t=2, prompt=3040, generated=130, local_only=3040),
             sample("d2", t=2, prompt=3040, generated=130, local_only=3040)]
    demand = measure_demand(t0, short)
    assert demand.local_prefill_tokens_per_s == demand.prefill_tokens_per_s == 3040
    decision = policy.tick(tick_input(2.0, demand, short, DEFAULTS))
    assert decision.flips == 0 and "balanced" in decision.reason, decision
    # the same tokens from prompts long enough for a remote prefill: a prefill worker takes them
    long = [sample("d1", t=2, prompt=3040, generated=130), sample("d2", t=2, prompt=3040, generated=130)]
    assert policy.tick(tick_input(2.0, measure_demand(t0, long), long, DEFAULTS)).flips == 1
    # a worker whose count went back (a flip restarted its role) adds none; never more than computed
    back = measure_demand(by_id(*short), [sample("d1", t=4, prompt=4040, generated=130, local_only=0),
                                          sample("d2", t=4, prompt=3040, generated=130, local_only=9000)])
    assert back.prefill_tokens_per_s == 500 and back.local_prefill_tokens_per_s == 500


def test_choose_flips_takes_only_ready_workers_of_the_giving_role():
    samples = [sample("d1", in_flight=2), sample("d2", in_flight=2), sample("d3", ready=False),
               sample("p1", role="prefill")]
    two = ScalingDecision(target_prefill=3, target_decode=1, flips=2, reason="")
    assert choose_flips(two, samples) == [Flip("d1", "prefill"), Flip("d2", "prefill")]
    assert choose_flips(ScalingDecision(0, 4, -1, ""), samples) == [Flip("p1", "decode")]
    assert choose_flips(ScalingDecision(1, 3, 0, "balanced"), samples) == []
    assert in_transition(samples) == ["d3"]


def test_max_per_role_bounds_the_target():
    demand_all_prefill = Demand(100_000.0, 1.0, 1.0)
    samples = [sample(f"d{i}") for i in range(4)]
    capped = RatioAutoscaler(AutoscaleConfig(cooldown_s=0, stabilization_s=0, min_prefill=0, max_prefill=2))
    assert capped.tick(tick_input(1.0, demand_all_prefill, samples, DEFAULTS)).target_prefill == 2
    uncapped = RatioAutoscaler(AutoscaleConfig(cooldown_s=0, stabilization_s=0, min_prefill=0))
    assert uncapped.tick(tick_input(1.0, demand_all_prefill, samples, DEFAULTS)).target_prefill == 3
    few_decode = RatioAutoscaler(AutoscaleConfig(cooldown_s=0, stabilization_s=0, min_prefill=0, max_decode=1))
    quiet = [sample(f"d{i}") for i in range(3)]
    assert few_decode.tick(tick_input(1.0, Demand(1.0, 100_000.0, 1.0), quiet, DEFAULTS)).target_decode == 1
