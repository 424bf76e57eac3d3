"""What the gateway does after a try at a request fails (pure): ask admission again now, wait and
ask again, continue the stream on another worker, or fail the request.

The gateway (``services.gateway.generation``) turns what happened into a ``Failure``, keeps the
counts in ``Attempts``, and acts on ``next_attempt``'s answer; the error a failed request gets
(its status and message) stays the gateway's, as it depends on what the client has been sent.

- Before the first token, a worker that broke the protocol or was lost is replaced at once, and
  one that refused (or that no one answered for) after a short wait, for the views to drop it;
  ``MAX_ADMISSIONS`` tries in all.
- After the first token, a lost or misbehaving worker's stream moves to another worker with the
  tokens so far as prompt (not a text worker's: its text cannot be another's prompt), at most
  ``MAX_MIGRATIONS`` times per request.
- "No worker can take it" (admission's answer, or the last try's) is waited out until the
  deadline, once a worker has been lost: the only one may be restarting.
- A request the worker called invalid, no first token in time, and a worker's error mid-stream
  fail the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

MAX_ADMISSIONS = 3   # tries per start: a worker may drain or die between admission and the gateway
MAX_MIGRATIONS = 2   # worker losses survived per request


class Failure(str, Enum):
    MISBEHAVED = "misbehaved"    # broke the protocol: malformed chunk, early end, silence mid-stream
    LOST = "lost"                # left the registry, restarted, its connection dropped, or it refused to go on
    REFUSED = "refused"          # before the first token: answered with an error, or no one answered
    BAD_REQUEST = "bad_request"  # the worker found the request invalid
    TIMEOUT = "timeout"          # no first token within the request timeout
    FAILED = "failed"            # the worker failed the request mid-stream
    NO_WORKER = "no_worker"      # no worker can take the request now


class Next(str, Enum):
    RETRY = "retry"       # ask admission again now
    WAIT = "wait"         # wait (a refresh interval, or for a ready worker), then ask again
    MIGRATE = "migrate"   # continue on another worker from the tokens generated so far
    FAIL = "fail"


@dataclass(frozen=True)
class Attempts:
    num_admissions: int = 0        # tries of the current start (or restart), the failed one included
    num_migrations: int = 0        # streams already moved to another worker
    streaming: bool = False        # the failure came after the first token
    is_text: bool = False          # a text worker's request
    wait_until: float | None = None  # "no worker" is waited out until then; None: not waited out


def next_attempt(now: float, failure: Failure, attempts: Attempts) -> Next:
    if failure in (Failure.BAD_REQUEST, Failure.TIMEOUT, Failure.FAILED):
        return Next.FAIL
    if failure is Failure.NO_WORKER:
        return Next.WAIT if attempts.wait_until is not None and now < attempts.wait_until else Next.FAIL
    if attempts.streaming:
        if attempts.num_migrations >= MAX_MIGRATIONS or attempts.is_text:
            return Next.FAIL
        return Next.MIGRATE
    if attempts.num_admissions >= MAX_ADMISSIONS:
        return Next.FAIL
    return Next.WAIT if failure is Failure.REFUSED else Next.RETRY
