"""The one exponential backoff (``shared.bus.backoff``) that connect, resume and restart loops share."""

import itertools

import pytest

from services.stack.supervisor import Backoff as RestartBackoff
from shared.bus.backoff import Backoff


def test_delays_double_from_the_initial_wait_up_to_the_cap_and_stay_there():
    backoff = Backoff(initial_s=0.05, factor=2.0, max_s=2.0)
    assert list(itertools.islice(backoff.delays(), 9)) == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]
    assert [backoff.delay_s(n) for n in range(1, 10)] == list(itertools.islice(backoff.delays(), 9))


def test_the_closed_form_equals_doubling_step_by_step_to_the_bit():
    """The loops this replaced doubled their delay each time (``min(delay * 2, cap)``)."""
    for initial_s, max_s in ((0.05, 2.0), (0.1, 2.0), (0.5, 30.0), (0.2, 1.0), (0.3, 7.7)):
        delay, stepped = initial_s, []
        for _ in range(40):
            stepped.append(delay)
            delay = min(delay * 2, max_s)
        assert list(itertools.islice(Backoff(initial_s, 2.0, max_s).delays(), 40)) == stepped


def test_a_failure_run_past_a_floats_range_waits_the_cap():
    backoff = Backoff(initial_s=0.5, factor=2.0, max_s=30.0)
    assert backoff.delay_s(1025) == backoff.delay_s(10**6) == 30.0  # 2.0 ** 1024 overflows a float


def test_there_is_no_wait_before_the_first_failure():
    with pytest.raises(AssertionError, match="no failure"):
        Backoff(initial_s=0.5, factor=2.0, max_s=30.0).delay_s(0)


def test_the_supervisors_backoff_is_this_one_with_its_defaults():
    restart = RestartBackoff()
    assert isinstance(restart, Backoff)
    assert (restart.initial_s, restart.factor, restart.max_s, restart.stable_after_s) == (0.5, 2.0, 30.0, 60.0)
    assert RestartBackoff(0.2, 3.0, 1.0, 5.0) == RestartBackoff(initial_s=0.2, factor=3.0, max_s=1.0,
                                                               stable_after_s=5.0)  # fields in their old order
    assert [restart.delay_s(n) for n in (1, 2, 7, 8)] == [0.5, 1.0, 30.0, 30.0]
