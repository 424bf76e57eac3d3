"""The gateway's retry and migration decision (shared.policy.attempts), case by case."""

import math

import pytest

from shared.policy.attempts import MAX_ADMISSIONS, MAX_MIGRATIONS, Attempts, Failure, Next, next_attempt


@pytest.mark.parametrize("failure, then", [(Failure.MISBEHAVED, Next.RETRY), (Failure.LOST, Next.RETRY),
                                           (Failure.REFUSED, Next.WAIT)])
def test_before_the_first_token_another_worker_is_tried_until_the_last_admission(failure, then):
    for n in range(1, MAX_ADMISSIONS):
        assert next_attempt(0.0, failure, Attempts(num_admissions=n)) is then
    assert next_attempt(0.0, failure, Attempts(num_admissions=MAX_ADMISSIONS)) is Next.FAIL


@pytest.mark.parametrize("failure", [Failure.BAD_REQUEST, Failure.TIMEOUT, Failure.FAILED])
def test_the_requests_own_fault_a_timeout_and_a_workers_error_fail_it_at_once(failure):
    for attempts in (Attempts(num_admissions=1), Attempts(streaming=True), Attempts(wait_until=math.inf)):
        assert next_attempt(0.0, failure, attempts) is Next.FAIL


@pytest.mark.parametrize("failure", [Failure.MISBEHAVED, Failure.LOST])
def test_mid_stream_a_lost_worker_is_migrated_a_bounded_number_of_times(failure):
    for n in range(MAX_MIGRATIONS):
        assert next_attempt(0.0, failure, Attempts(streaming=True, num_migrations=n)) is Next.MIGRATE
    assert next_attempt(0.0, failure, Attempts(streaming=True, num_migrations=MAX_MIGRATIONS)) is Next.FAIL


def test_a_text_workers_stream_is_never_migrated():
    assert next_attempt(0.0, Failure.LOST, Attempts(streaming=True, is_text=True)) is Next.FAIL


def test_no_worker_is_waited_out_only_with_a_deadline_and_until_it():
    assert next_attempt(5.0, Failure.NO_WORKER, Attempts()) is Next.FAIL  # nothing was lost: the answer stands
    assert next_attempt(5.0, Failure.NO_WORKER, Attempts(wait_until=10.0)) is Next.WAIT
    assert next_attempt(10.0, Failure.NO_WORKER, Attempts(wait_until=10.0)) is Next.FAIL
    assert next_attempt(1e9, Failure.NO_WORKER, Attempts(wait_until=math.inf)) is Next.WAIT
