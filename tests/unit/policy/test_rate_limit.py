"""The gateway's per-client token buckets, driven by a fake clock."""

import pytest

from shared.policy.rate_limit import RateLimiter, TokenBucket, is_limited_path


def test_a_burst_then_one_request_per_refill_and_retry_after_until_the_next_token():
    limiter = RateLimiter(rate_per_s=2.0, burst=3)
    assert [limiter.acquire("k1", now_s=100.0) for _ in range(3)] == [None, None, None]
    assert limiter.acquire("k1", now_s=100.0) == pytest.approx(0.5)   # one token takes 1/2 s
    assert limiter.acquire("k1", now_s=100.2) == pytest.approx(0.3)   # 0.4 of a token there
    assert limiter.acquire("k1", now_s=100.5) is None                  # refused tries cost nothing
    assert limiter.acquire("k1", now_s=100.5) == pytest.approx(0.5)


def test_clients_have_their_own_buckets():
    limiter = RateLimiter(rate_per_s=1.0, burst=1)
    assert limiter.acquire("key:a", now_s=0.0) is None
    assert limiter.acquire("key:a", now_s=0.0) == pytest.approx(1.0)
    assert limiter.acquire("key:b", now_s=0.0) is None


def test_refill_stops_at_the_burst_and_a_clock_step_back_refills_nothing():
    bucket = TokenBucket(rate_per_s=10.0, burst=2, tokens=0.0, updated_s=50.0)
    bucket.refill(now_s=3600.0)
    assert bucket.tokens == 2.0
    assert bucket.take(3600.0) is None and bucket.take(3600.0) is None
    assert bucket.take(3599.0) == pytest.approx(0.1)  # earlier "now": no tokens appear


def test_idle_clients_are_forgotten_once_their_buckets_refill():
    limiter = RateLimiter(rate_per_s=1.0, burst=2)
    limiter.acquire("busy", now_s=0.0)
    limiter.acquire("busy", now_s=0.0)
    limiter.acquire("idle", now_s=0.0)
    limiter.prune(now_s=1.0)  # idle refilled to 2, busy has 1
    assert len(limiter) == 1
    assert limiter.acquire("busy", now_s=1.0) is None and limiter.acquire("busy", now_s=1.0) is not None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/files", "/v1/files/file-1/content", "/v1/batches",
                                  "/v1/responses/resp-1/input_items", "/v1/models", "/v1/embeddings", "/tokenize",
                                  "/detokenize"])
def test_every_api_call_counts_against_the_limit(path):
    assert is_limited_path(path)


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/status", "/dashboard", "/dashboard/data",
                                  "/tokenize/x", "/v1"])
def test_probes_and_operator_pages_do_not(path):
    assert not is_limited_path(path)
