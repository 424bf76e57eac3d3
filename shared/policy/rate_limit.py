"""Requests per client at the gateway: one token bucket per API key (per peer address when keys are
off). Pure: the caller passes ``now_s`` (a monotonic clock), so tests drive it with a fake one.

A bucket holds up to ``burst`` tokens and refills at ``rate_per_s``; a request takes one token or is
refused with the time until one is there (the ``Retry-After``). A full bucket is the same as no
bucket, which is what lets ``RateLimiter`` forget idle clients and stay bounded.

These buckets are one gateway process's; ``shared.store.rate_limit`` keeps the same buckets in Redis
for every gateway of a stack and falls back to these when Redis does not answer.
"""

from __future__ import annotations

from dataclasses import dataclass

_PRUNE_EVERY = 1024  # new clients between two sweeps of the buckets that refilled

# the gateway's paths outside /v1/ that API clients call, and so spend their tokens
_CLIENT_PATHS = ("/tokenize", "/detokenize")


def is_limited_path(path: str) -> bool:
    """Whether a request to ``path`` counts against its client's limit: every API call (``/v1/``
    and below: generations, files, uploads, batches, stored responses, conversations, models, and
    the lists of them; ``/tokenize``, ``/detokenize``), not probes (``/health``, ``/ready``) or the
    operator pages (``/status``, ``/metrics``, ``/dashboard``)."""
    return path.startswith("/v1/") or path in _CLIENT_PATHS


@dataclass
class TokenBucket:
    rate_per_s: float
    burst: float
    tokens: float
    updated_s: float

    def refill(self, now_s: float) -> None:
        elapsed = max(0.0, now_s - self.updated_s)  # a clock that stepped back refills nothing
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate_per_s)
        self.updated_s = max(self.updated_s, now_s)

    def take(self, now_s: float) -> float | None:
        """Take one token: None when taken, else the seconds until one will be there."""
        self.refill(now_s)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return None
        return (1.0 - self.tokens) / self.rate_per_s

    def is_full(self, now_s: float) -> bool:
        self.refill(now_s)
        return self.tokens >= self.burst


class RateLimiter:
    """A token bucket per client id, created full on a client's first request."""

    def __init__(self, rate_per_s: float, burst: int) -> None:
        assert rate_per_s > 0 and burst >= 1, f"rate_per_s={rate_per_s} burst={burst}"
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._buckets: dict[str, TokenBucket] = {}
        self._num_new = 0

    def acquire(self, client_id: str, now_s: float) -> float | None:
        """Admit one request of ``client_id``: None when admitted, else the seconds to wait."""
        bucket = self._buckets.get(client_id)
        if bucket is None:
            self._num_new += 1
            if self._num_new % _PRUNE_EVERY == 0:
                self.prune(now_s)
            bucket = self._buckets[client_id] = TokenBucket(self.rate_per_s, self.burst, self.burst, now_s)
        return bucket.take(now_s)

    def prune(self, now_s: float) -> None:
        """Forget the clients whose buckets refilled: they would start full again anyway."""
        self._buckets = {c: b for c, b in self._buckets.items() if not b.is_full(now_s)}

    def __len__(self) -> int:
        return len(self._buckets)
