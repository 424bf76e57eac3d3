"""Where a request's time to first token went: its phases, measured as consecutive intervals of
one timeline, and the W3C ``Server-Timing`` header that reports them.

The decode worker measures its part from the moment it receives the request to its first token
(``worker_phases``); the gateway adds its own work, admission's round trip, and ``bus``: the rest
of its wait for the first chunk (the NATS hops there and back and the scheduling of the processes
in between; several milliseconds on a loaded machine). The phases are consecutive intervals of
the TTFT the gateway measures (sent as ``total``): their sum matches it, and can only exceed it
if a phase were counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass

TOTAL = "total"


@dataclass(frozen=True)
class RemoteTimes:
    """A remote prefill as the decode worker saw it (``time.monotonic`` seconds) and as the
    prefill worker reported it in its notification (durations)."""

    published_at: float     # the request is on the prefill queue
    delivered_at: float     # the KV notification arrived
    queue_wait_s: float     # on the prefill queue until a prefill worker took it
    prefill_s: float        # that worker's compute


def worker_phases(received_at: float, first_output_at: float, *, scheduled_at: float | None = None,
                  remote: RemoteTimes | None = None) -> dict[str, float]:
    """The decode worker's phases (seconds), a partition of ``[received_at, first_output_at]``.

    Local prefill: ``queue`` until the engine first schedules the request, ``prefill`` until its
    first token (the last prefill chunk samples it). Remote: ``queue`` until it is published,
    ``prefill_queue`` and ``prefill`` as the prefill worker reports them, ``transfer`` the rest
    until the notification (the KV write and the notification's way back), ``first_step`` until
    the first token."""
    if remote is None:
        scheduled = first_output_at if scheduled_at is None else min(max(scheduled_at, received_at), first_output_at)
        return {"queue": scheduled - received_at, "prefill": first_output_at - scheduled}
    waited = remote.delivered_at - remote.published_at
    queue_wait = min(remote.queue_wait_s, waited)
    prefill = min(remote.prefill_s, waited - queue_wait)
    return {"queue": remote.published_at - received_at, "prefill_queue": queue_wait, "prefill": prefill,
            "transfer": waited - queue_wait - prefill, "first_step": first_output_at - remote.delivered_at}


def server_timing(phases: dict[str, float], total_s: float) -> str:
    """``Server-Timing`` value: one metric per phase, then ``total``, durations in milliseconds."""
    items = [*phases.items(), (TOTAL, total_s)]
    return ", ".join(f"{name};dur={seconds * 1000:.3f}" for name, seconds in items)


def parse_server_timing(value: str) -> dict[str, float]:
    """Metric name → duration in seconds, from a ``Server-Timing`` value (metrics without ``dur``
    are skipped)."""
    out: dict[str, float] = {}
    for metric in value.split(","):
        name, *params = [p.strip() for p in metric.split(";")]
        for param in params:
            key, _, val = param.partition("=")
            if key.strip() == "dur" and name:
                out[name] = float(val) / 1000
    return out
