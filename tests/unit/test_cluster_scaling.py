"""The autoscaler's tick without the bus: cluster view → plan → record, as ``tandem status`` shows it."""

from shared.cluster.scaling import Autoscaling, worker_sample
from shared.policy.autoscale import AutoscaleConfig, RatioAutoscaler
from shared.policy.autoscale_inputs import Capacities, Flip
from shared.protocol import ScalingAction, WorkerInfo, WorkerLoad, WorkerStatus


def status(worker_id, t, prompt=0, generated=0, role="decode", state="ready", load_role=None, running=0, waiting=0,
           slots=1):
    info = WorkerInfo(worker_id=worker_id, role=role, state=state, model="m", block_size=16, max_model_len=256,
                      generate_subject="g")
    load = WorkerLoad(worker_id=worker_id, role=load_role or role, seq=int(t) + 1, timestamp=t, num_running=running, num_waiting=waiting,
                      num_prompt_tokens_total=prompt, num_generated_tokens_total=generated, max_num_seqs=slots)
    return WorkerStatus(info=info, load=load)


def scaling(window_s=60.0):
    return Autoscaling(RatioAutoscaler(AutoscaleConfig(cooldown_s=10, stabilization_s=0, min_prefill=0,
                                                       min_decode=1)),
                       Capacities(prefill_tokens_per_s=1000, decode_tokens_per_s=100), window_s=window_s)


def test_long_prompts_plan_a_flip_and_the_record_keeps_reason_rates_and_actions():
    s = scaling()
    first = s.plan(0.0, [status("d1", 0), status("d2", 0)])
    assert first.decision is None and first.reason == "no load reports to compare yet"
    plan = s.plan(2.0, [status("d1", 2, prompt=4000, generated=2, running=2),
                        status("d2", 2, prompt=4000, generated=2)])
    assert plan.decision.flips == 1 and plan.flips == (Flip("d2", "prefill"),)
    record = s.record(plan, [ScalingAction(kind="flip", worker_id="d2", role="prefill", ok=True)])
    assert (record.num_prefill, record.num_decode, record.target_prefill, record.target_decode) == (0, 2, 1, 1)
    assert (record.prefill_tokens_per_s, record.decode_tokens_per_s) == (4000.0, 2.0)
    assert record.reason == plan.reason and "prefill share" in record.reason
    shown = s.status(enabled=True)
    assert shown.recent == [record] and shown.last_reason == plan.reason and shown.last_tick_at == 2.0


def test_no_decision_while_a_worker_is_flipping_and_quiet_ticks_are_not_recorded():
    s = scaling()
    s.plan(0.0, [status("d1", 0), status("d2", 0)])
    waiting = s.plan(2.0, [status("d1", 2, prompt=4000), status("d2", 2, prompt=4000, state="draining")])
    assert waiting.decision is None and waiting.reason.startswith("waiting for d2")
    assert s.plan(4.0, [status("d1", 4, prompt=4000), status("d2", 4, prompt=4000)]).reason == "cooling down"
    quiet = s.plan(20.0, [status("d1", 20, prompt=4000, generated=4000), status("d2", 20, prompt=4000, generated=4000)])
    assert quiet.decision.flips == 0 and s.record(quiet, []) is None
    assert s.status(enabled=True).recent == [] and s.status(enabled=True).last_reason.startswith("balanced")


def test_the_cooldown_counts_from_when_the_flip_is_done():
    s = scaling()
    s.plan(0.0, [status("d1", 0), status("d2", 0)])
    assert s.plan(2.0, [status("d1", 2, prompt=4000), status("d2", 2, prompt=4000)]).decision.flips == 1
    for t in (4.0, 8.0, 14.0):  # d2 drains and flips for 12 s, longer than the cooldown
        s.plan(t, [status("d1", t, prompt=4000), status("d2", t, prompt=4000, state="draining")])
    busy = [status("d1", 16, prompt=4000, generated=4000), status("d2", 16, prompt=4000, role="prefill")]
    assert s.plan(16.0, busy).reason == "cooling down"
    later = [status("d1", 25, prompt=4000, generated=8000), status("d2", 25, prompt=4000, role="prefill")]
    assert s.plan(25.0, later).decision.flips == -1


def test_demand_is_measured_over_the_window_not_the_last_tick():
    s = scaling(window_s=10.0)
    s.plan(0.0, [status("d1", 0)])
    s.plan(5.0, [status("d1", 5, prompt=1000)])
    plan = s.plan(10.0, [status("d1", 10, prompt=1000, generated=100)])
    assert (plan.tick.prefill_tokens_per_s, plan.tick.decode_tokens_per_s) == (100.0, 10.0)  # over 0..10
    plan = s.plan(12.0, [status("d1", 12, prompt=1000, generated=120)])
    assert (plan.tick.prefill_tokens_per_s, plan.tick.decode_tokens_per_s) == (0.0, 120 / 7)  # over 5..12
    assert s.status(enabled=True).last_decision.decode_tokens_per_s == 120 / 7


def test_a_report_from_the_role_before_a_flip_keeps_the_engines_counters():
    sample = worker_sample(status("d2", 5, prompt=900, generated=900, role="prefill", load_role="decode"))
    assert (sample.role, sample.timestamp, sample.num_prompt_tokens, sample.is_ready) == ("prefill", 5, 900, True)


def fleet_scaling():
    from shared.policy.fleet import FleetAutoscaler, FleetConfig

    return Autoscaling(RatioAutoscaler(AutoscaleConfig(cooldown_s=10, stabilization_s=0, min_prefill=0,
                                                       min_decode=1)),
                       Capacities(prefill_tokens_per_s=1000, decode_tokens_per_s=100), window_s=60.0,
                       fleet=FleetAutoscaler(FleetConfig(min_workers=1, max_workers=3, cooldown_s=10)))


def test_a_busy_fleet_plans_a_start_and_waits_for_the_new_worker_before_deciding_again():
    s = fleet_scaling()
    s.plan(0.0, [status("d1", 0)])
    plan = s.plan(2.0, [status("d1", 2, generated=190)])  # 95 tok/s on one worker
    assert plan.start == "decode" and plan.flips == () and plan.stop is None and "scale up to 2" in plan.reason
    record = s.record(plan, [ScalingAction(kind="start", worker_id="d2", role="decode", ok=True)])
    assert (record.num_decode, record.target_decode) == (1, 2)
    s.started("d2", 2.0)
    # d2 loads its model before it registers: not in the registry yet, still counted as starting
    waiting = s.plan(4.0, [status("d1", 4, generated=380)])
    assert waiting.decision is None and waiting.reason.startswith("waiting for d2")
    ready = s.plan(6.0, [status("d1", 6, generated=570), status("d2", 6)])
    assert ready.reason == "fleet cooling down; cooling down" and not ready.is_acting


def test_an_idle_fleet_stops_the_worker_with_the_least_in_flight():
    s = fleet_scaling()
    s.plan(0.0, [status("d1", 0), status("d2", 0), status("d3", 0)])
    plan = s.plan(2.0, [status("d1", 2, generated=20, running=2, slots=4), status("d2", 2, generated=20, running=1,
                        slots=4), status("d3", 2, generated=20, running=3, slots=4)])
    assert plan.stop == Flip("d2", "decode") and plan.start is None and "scale down to 2" in plan.reason
    assert s.record(plan, []) is not None


def test_a_queue_starts_a_worker_only_when_every_sample_in_the_window_shows_it():
    # a request waits from its arrival until the next step schedules it: one sample of a worker
    # with free slots can show it queued, and that is no reason to start another worker
    s = fleet_scaling()
    s.plan(0.0, [status("d1", 0)])
    blip = s.plan(2.0, [status("d1", 2, generated=20, running=1, waiting=1)])
    assert blip.start is None and "fleet of 1 kept" in blip.reason
    s.plan(4.0, [status("d1", 4, generated=40, running=2, waiting=2)])
    s = fleet_scaling()
    s.plan(0.0, [status("d1", 0, running=2, waiting=2)])
    plan = s.plan(2.0, [status("d1", 2, generated=20, running=2, waiting=1)])
    assert plan.start == "decode" and "1.0 waiting per worker" in plan.reason


def test_requests_waiting_for_a_free_slot_start_no_worker_however_long_it_lasts():
    # two sequence slots, two clients: each new request waits one step for the slot its
    # predecessor freed (a slow step on a busy machine makes every sample catch one)
    s = fleet_scaling()
    for t in range(0, 12, 2):
        plan = s.plan(float(t), [status("d1", t, generated=10 * t, running=1, waiting=1, slots=2)])
        assert plan.start is None, plan.reason
    full = fleet_scaling()  # the same queue on a worker whose slots are all taken is a queue
    full.plan(0.0, [status("d1", 0, running=2, waiting=1, slots=2)])
    plan = full.plan(2.0, [status("d1", 2, generated=20, running=2, waiting=1, slots=2)])
    assert plan.start == "decode", plan.reason


def test_a_decode_worker_is_stopped_only_when_the_others_slots_hold_what_is_in_flight():
    s = fleet_scaling()  # utilisation near 0 and nothing waiting, but 4 streams fill both workers' 2 slots
    s.plan(0.0, [status("d1", 0, slots=2), status("d2", 0, slots=2)])
    busy = s.plan(2.0, [status("d1", 2, generated=20, running=2, slots=2), status("d2", 2, generated=20, running=2,
                                                                                    slots=2)])
    assert busy.stop is None and "fleet of 2 kept" in busy.reason
    light = s.plan(4.0, [status("d1", 4, generated=40, running=1, slots=2), status("d2", 4, generated=40, running=1,
                                                                                     slots=2)])
    assert light.stop is not None and "scale down to 1" in light.reason


def test_without_a_fleet_policy_the_fleet_is_never_resized():
    s = scaling()
    s.plan(0.0, [status("d1", 0)])
    plan = s.plan(2.0, [status("d1", 2, generated=1000, running=8)])
    assert plan.start is None and plan.stop is None
