"""The fleet-size policy on numbers: when a worker is started or stopped, of which role, and what
holds a change back (bounds, hysteresis, cooldown, role minimums)."""

import pytest

from shared.policy.autoscale import TickInput
from shared.policy.fleet import FleetAutoscaler, FleetConfig

# one decode worker: 100 output tok/s; one prefill worker: 1000 prompt tok/s
CAP = {"prefill_capacity_tokens_per_s": 1000.0, "decode_capacity_tokens_per_s": 100.0}


def tick(now_s, *, decode=1, prefill=0, out=0.0, prompt=0.0, waiting=0):
    return TickInput(now_s=now_s, num_prefill=prefill, num_decode=decode, prefill_tokens_per_s=prompt,
                     decode_tokens_per_s=out, num_waiting=waiting, **CAP)


def fleet(**kw):
    return FleetAutoscaler(FleetConfig(**{"min_workers": 1, "max_workers": 3, "cooldown_s": 10.0, **kw}))


def test_busy_workers_start_one_more_up_to_max_workers():
    f = fleet()
    up = f.tick(tick(0, decode=1, out=90))
    assert (up.delta, up.role) == (1, "decode") and "utilisation 0.90" in up.reason
    assert f.tick(tick(20, decode=2, out=190)).delta == 1
    at_max = f.tick(tick(40, decode=3, out=300))
    assert at_max.delta == 0 and "fleet of 3 kept" in at_max.reason


def test_queued_requests_start_a_worker_even_when_measured_demand_looks_low():
    # a saturated fleet computes at its capacity and no more: the queue shows the rest
    decision = fleet().tick(tick(0, decode=2, out=50, waiting=2))
    assert decision.delta == 1 and "1.0 waiting per worker" in decision.reason
    # the same queue seen in one sample only (the window's fewest: none) starts nothing
    blip = TickInput(**{**tick(0, decode=2, out=50, waiting=2).__dict__, "num_waiting_sustained": 0})
    assert fleet().tick(blip).delta == 0


def test_a_worker_is_stopped_only_if_the_rest_stay_below_scale_down_at():
    f = fleet()
    assert f.tick(tick(0, decode=3, out=100)).delta == 0       # 2 left would be 0.50 busy: kept
    down = f.tick(tick(0, decode=3, out=70))                    # 2 left: 0.35
    assert (down.delta, down.role) == (-1, "decode") and "scale down to 2" in down.reason
    assert fleet().tick(tick(0, decode=3, out=10, waiting=1)).delta == 0  # something queues: kept


def test_hysteresis_a_fleet_just_scaled_down_does_not_scale_up_again():
    f = fleet(cooldown_s=0.0)
    assert f.tick(tick(0, decode=2, out=40)).delta == -1
    assert f.tick(tick(1, decode=1, out=40)).delta == 0  # 0.40 on one worker: between the thresholds


def test_cooldown_and_hold_postpone_the_next_change():
    f = fleet()
    assert f.tick(tick(0, decode=1, out=95)).delta == 1
    assert f.tick(tick(5, decode=2, out=195)).reason == "fleet cooling down"
    f.hold(12.0)  # the new worker was still starting at 12 s
    assert f.tick(tick(15, decode=2, out=195)).delta == 0
    assert f.tick(tick(23, decode=2, out=195)).delta == 1


def test_min_workers_and_role_minimums_hold_a_scale_down_back():
    assert fleet(min_workers=2).tick(tick(0, decode=2, out=0)).delta == 0
    kept = fleet(min_decode=1, min_prefill=1).tick(tick(0, decode=1, prefill=1))
    assert kept.delta == 0


def test_the_new_worker_takes_the_busier_role_and_the_idler_role_gives_one_up():
    f = fleet(cooldown_s=0.0)
    # prefill workers at 1.8 each, decode at 0.5: one more prefill worker
    assert f.tick(tick(0, decode=1, prefill=1, out=50, prompt=1800)).role == "prefill"
    # no prefill worker yet: decode workers prefill locally, so the new one decodes
    assert f.tick(tick(1, decode=1, prefill=0, out=10, prompt=5000)).role == "decode"
    down = f.tick(tick(2, decode=2, prefill=1, out=20, prompt=400))
    assert (down.delta, down.role) == (-1, "decode")


def test_above_max_workers_one_is_stopped_at_once():
    f = fleet(max_workers=2)
    f.tick(tick(0, decode=1, out=95))
    decision = f.tick(tick(1, decode=3, out=300))  # even in the cooldown
    assert decision.delta == -1 and "above max_workers 2" in decision.reason


@pytest.mark.parametrize("kw, field", [({"min_workers": 3, "max_workers": 2}, "min_workers"),
                                       ({"scale_up_at": 0.4, "scale_down_at": 0.5}, "scale_down_at")])
def test_bad_bounds_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        FleetConfig(**{"min_workers": 1, "max_workers": 3, **kw})


def test_a_fleet_below_min_workers_waits_for_the_missing_worker():
    # no worker ready (a crash being restarted, or heartbeats missed on a busy machine): every
    # threshold reads as met on zero workers, and starting one would overshoot when it comes back
    gone = fleet().tick(tick(0, decode=0))
    assert gone.delta == 0 and "0 ready, below min_workers 1" in gone.reason
    assert fleet(min_workers=2).tick(tick(0, decode=1, out=95, waiting=3)).delta == 0
    assert fleet().tick(tick(0, decode=1, out=95)).delta == 1
