"""The restart policy of ``tandem up``'s supervisor, on a fake clock."""

import signal

import pytest

from services.stack.supervisor import Backoff, RestartPolicy, describe_exit

BACKOFF = Backoff(initial_s=0.5, factor=2.0, max_s=4.0, stable_after_s=60.0)


def test_a_crash_loop_backs_off_exponentially_up_to_the_cap_and_keeps_retrying():
    policy = RestartPolicy(BACKOFF)
    now = 0.0
    assert policy.started("admission", now) == 0
    delays = []
    for _ in range(7):
        now += 1.0  # dies a second after each start
        decision = policy.exited("admission", 2, now)
        delays.append(decision.restart_in_s)
        assert policy.due(now + decision.restart_in_s - 0.01) == []
        now += decision.restart_in_s
        assert policy.due(now) == ["admission"]
        assert policy.started("admission", now) == decision.num_restarts
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    assert policy.num_restarts("admission") == 7
    assert decision.describe() == ("admission exited (exit code 2) after 1.0s; restart 7 in 4s, "
                                   "7 crashes in a row")


def test_a_child_that_ran_long_enough_starts_over_at_the_initial_delay():
    policy = RestartPolicy(BACKOFF)
    policy.started("decode-1", 0.0)
    assert policy.exited("decode-1", -signal.SIGKILL, 1.0).restart_in_s == 0.5
    policy.started("decode-1", 1.5)
    assert policy.exited("decode-1", -signal.SIGKILL, 2.0).restart_in_s == 1.0
    policy.started("decode-1", 3.0)
    decision = policy.exited("decode-1", -signal.SIGKILL, 100.0)
    assert (decision.restart_in_s, decision.num_restarts, decision.num_consecutive_crashes) == (0.5, 3, 1)
    assert decision.describe() == "decode-1 exited (signal SIGKILL) after 97.0s; restart 3 in 0.5s"


def test_a_clean_exit_is_not_restarted():
    policy = RestartPolicy(BACKOFF)
    policy.started("decode-2", 0.0)
    decision = policy.exited("decode-2", 0, 5.0)
    assert decision.restart_in_s is None and "not restarted" in decision.describe()
    assert policy.has_exited("decode-2") and policy.due(1e9) == []
    assert policy.num_restarts("decode-2") == 0


def test_a_server_is_restarted_even_after_a_clean_exit():
    policy = RestartPolicy(BACKOFF)
    policy.started("nats-server", 0.0)
    decision = policy.exited("nats-server", 0, 5.0, is_crash=True)
    assert (decision.restart_in_s, decision.num_restarts) == (0.5, 1)
    assert decision.describe() == "nats-server exited (exit code 0) after 5.0s; restart 1 in 0.5s"
    assert policy.due(5.5) == ["nats-server"]


def test_an_exit_is_recorded_once_per_start():
    policy = RestartPolicy(BACKOFF)
    policy.started("gateway", 0.0)
    policy.exited("gateway", 1, 1.0)
    with pytest.raises(AssertionError, match="exited twice"):
        policy.exited("gateway", 1, 2.0)


def test_exits_are_described_by_code_or_signal_name():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGTERM) == "signal SIGTERM"
