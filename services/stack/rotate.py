"""The embedded NATS's login, kept across restarts and rotated on purpose with an overlap window.

``KeptLogin`` (``services/stack/nats_login.py``) lives in the NATS data directory (``login.json``, its owner's alone): the logins the
servers accept (the current one first), their client ports, and while a rotation overlaps, when
the old login goes. A rotation adds a new login under the other of two user names (nats-server
refuses two logins of one user, and the URL names the user), so for the overlap both the old URL
and the new one log in; then the old one is dropped and the server disconnects whoever still uses
it. There is at most one old login: a second rotation waits until the first one's overlap ended.

``tandem credentials`` asks the running ``tandem up`` through two files beside it (a request and
its answer), because only that process can reconfigure the servers it started and restart its own
services with the new URL; ``Rotator`` is ``tandem up``'s side, polled from its main loop.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from services.stack.nats_login import KeptLogin
from services.stack.servers import private_file

if TYPE_CHECKING:
    from services.stack.stack import Stack

REQUEST_FILE = "credentials-request.json"
ANSWER_FILE = "credentials-answer.json"


# -- tandem credentials <-> tandem up ---------------------------------------------------------------

@dataclass(frozen=True)
class CredentialsRequest:
    action: str                      # "rotate" or "finish"
    overlap_s: float = 0.0           # rotate: how long the old login stays accepted
    request_id: str = ""


@dataclass(frozen=True)
class CredentialsAnswer:
    request_id: str
    is_done: bool
    message: str


def _write_atomically(path: Path, data: dict) -> None:
    """A reader never sees half a file: written beside it, then renamed over it."""
    tmp = private_file(path.with_name(path.name + f".{os.getpid()}.tmp"), json.dumps(data))
    tmp.replace(path)


def send_request(directory: Path, request: CredentialsRequest) -> CredentialsRequest:
    """Leave ``request`` for the ``tandem up`` whose NATS data directory is ``directory``."""
    request = replace(request, request_id=request.request_id or uuid.uuid4().hex)
    _write_atomically(directory / REQUEST_FILE, {"action": request.action, "overlap_s": request.overlap_s,
                                                 "request_id": request.request_id})
    return request


def take_request(directory: Path) -> CredentialsRequest | None:
    """The request waiting in ``directory``, removed (an unreadable one is dropped too)."""
    path = directory / REQUEST_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        data = None
    path.unlink(missing_ok=True)
    try:
        return CredentialsRequest(str(data["action"]), float(data["overlap_s"]), str(data["request_id"]))
    except (TypeError, KeyError, ValueError):
        return None


def withdraw_request(directory: Path, request: CredentialsRequest) -> None:
    """Remove ``request`` if nobody took it (a later ``tandem up`` must not act on it unasked)."""
    path = directory / REQUEST_FILE
    try:
        if json.loads(path.read_text()).get("request_id") == request.request_id:
            path.unlink(missing_ok=True)
    except (OSError, ValueError, AttributeError):
        pass


def write_answer(directory: Path, answer: CredentialsAnswer) -> None:
    _write_atomically(directory / ANSWER_FILE, {"request_id": answer.request_id, "is_done": answer.is_done,
                                                "message": answer.message})


def wait_answer(directory: Path, request: CredentialsRequest, timeout_s: float) -> CredentialsAnswer | None:
    """The answer to ``request``, or None when none came within ``timeout_s`` (the request withdrawn)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            data = json.loads((directory / ANSWER_FILE).read_text())
            if data.get("request_id") == request.request_id:
                return CredentialsAnswer(request.request_id, bool(data["is_done"]), str(data["message"]))
        except (OSError, ValueError, KeyError, AttributeError):
            pass
        time.sleep(0.1)
    withdraw_request(directory, request)
    return None


def _clock(epoch_s: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(epoch_s))


@dataclass(frozen=True)
class GatewayView:
    """What the first gateway sees: ready workers (``/ready``) and the processes in the service
    directory (``/status``), each of which is connected to NATS."""
    num_ready_decode: int
    num_ready_prefill: int
    pids: frozenset[int]


@dataclass
class RollingRestart:
    """Children still to restart with the new login, one at a time: the next one only once the
    gateway lists the last one's new process and sees as many ready workers as before it (or
    ``step_timeout_s`` passed; at once where no gateway answered before it)."""
    pending: list[str]
    step_timeout_s: float = 120.0
    last_pid: int | None = None
    before: GatewayView | None = None
    step_deadline_s: float = 0.0

    def is_waiting(self, seen: GatewayView | None, now_s: float) -> bool:
        """Whether the last restart is still coming back (``seen``: the gateway's view now)."""
        if self.before is None or now_s >= self.step_deadline_s:
            return False
        return seen is None or self.last_pid not in seen.pids or \
            seen.num_ready_decode < self.before.num_ready_decode or \
            seen.num_ready_prefill < self.before.num_ready_prefill


class Rotator:
    """``tandem up``'s side: ``poll(now_s)`` from its main loop serves a waiting request, restarts
    this host's own services one at a time with the new URL (their environment holds the old one),
    and drops the old login once the overlap is over and they all have the new one, so none of them
    is cut off. It runs on the main thread because a child dies with the thread that started it.
    ``write_connect`` rewrites connect.env from the stack's current URL."""

    def __init__(self, stack: "Stack", write_connect: Callable[[], Path], new_password: Callable[[], str]) -> None:
        self.stack = stack
        self._write_connect = write_connect
        self._new_password = new_password
        self._directory = stack.spec.state_dir / "nats"
        self._roll: RollingRestart | None = None
        self._next_drop_s = 0.0  # after a failed drop, when to try again

    @property
    def is_rolling(self) -> bool:
        return self._roll is not None

    def poll(self, now_s: float) -> None:
        if not self._directory.is_dir():
            return
        if (request := take_request(self._directory)) is not None:
            write_answer(self._directory, self.serve(request, now_s))
        if self._roll is not None:
            self._restart_next(self._roll, time.monotonic())
        kept = self.stack.nats_login
        if kept is not None and kept.is_due(now_s) and not self.is_rolling and now_s >= self._next_drop_s:
            try:
                self._drop_old(kept)
            except RuntimeError as exc:  # a member refused the reload: tried again, tandem up keeps serving
                self._next_drop_s = now_s + 30.0
                self.stack.log_line(f"could not drop the old NATS login (again in 30s): {exc}")

    def serve(self, request: CredentialsRequest, now_s: float) -> CredentialsAnswer:
        kept = self.stack.nats_login
        refused = self._refusal(request, kept)
        if refused:
            return CredentialsAnswer(request.request_id, False, refused)
        try:
            message = self._rotate(kept, request.overlap_s, now_s) if request.action == "rotate" \
                else self._drop_old(kept)
        except RuntimeError as exc:
            return CredentialsAnswer(request.request_id, False, str(exc).splitlines()[0])
        return CredentialsAnswer(request.request_id, True, message)

    def _refusal(self, request: CredentialsRequest, kept: KeptLogin | None) -> str | None:
        if kept is None:
            return "this tandem up uses a NATS it did not start (--nats-url): rotate its credentials where it runs"
        if request.action == "rotate" and kept.is_overlapping:
            return (f"a rotation is under way: the old login ({kept.logins[1].user}) is accepted until "
                    f"{_clock(kept.old_until_s or 0)}; `tandem credentials finish` ends it now")
        if request.action == "rotate" and request.overlap_s <= 0:
            return f"overlap_s must be positive, got {request.overlap_s:g}"
        if request.action == "finish" and not kept.is_overlapping:
            return "no rotation under way: NATS accepts one login only"
        if request.action == "finish" and self.is_rolling:
            return "this host's own services are still restarting with the new login: try again once tandem up says so"
        if request.action not in ("rotate", "finish"):
            return f"unknown action {request.action!r}"
        return None

    def _rotate(self, kept: KeptLogin, overlap_s: float, now_s: float) -> str:
        rotated = kept.rotated(self._new_password(), now_s, overlap_s)
        try:
            self.stack.set_nats_login(rotated)
        except RuntimeError:  # a member refused it: the others back to the old login alone
            try:
                self.stack.set_nats_login(kept)
            except RuntimeError as exc:
                self.stack.log_line(f"NATS login rotation failed and could not be undone everywhere: {exc}")
            raise
        connect = self._write_connect()
        self.stack.log_line(f"NATS login rotated: {rotated.current.user} is current, {kept.current.user} accepted "
                            f"until {_clock(rotated.old_until_s or now_s)}; {connect} has the new one")
        self._roll = RollingRestart(self.stack.rolling_order())
        return (f"NATS now accepts the new login ({rotated.current.user}) and the old one ({kept.current.user}) until "
                f"{_clock(rotated.old_until_s or now_s)} ({overlap_s:g}s); {connect} has the new one: copy it over "
                f"the old one on every joined host before then (a running tandem join takes it over). This host's "
                f"services restart with it one at a time now.")

    def _drop_old(self, kept: KeptLogin) -> str:
        finished = kept.finished()
        self.stack.set_nats_login(finished)
        line = f"NATS accepts the login {finished.current.user} alone now: {kept.logins[1].user} dropped"
        self.stack.log_line(line)
        return line

    def _restart_next(self, roll: RollingRestart, now_s: float) -> None:
        if roll.is_waiting(self._gateway_view(), now_s):
            return
        if not roll.pending:
            self._roll = None
            self.stack.log_line("every service of this host runs with the new NATS login")
            return
        roll.before, roll.step_deadline_s = self._gateway_view(), now_s + roll.step_timeout_s
        child = self.stack.restart_child(roll.pending.pop(0))
        if child is None:  # the stack is stopping
            self._roll = None
        else:
            roll.last_pid = child.pid

    def _gateway_view(self) -> GatewayView | None:
        ready, pids = self.stack.ready_status(), self.stack.listed_pids()
        if ready is None or pids is None:
            return None
        return GatewayView(ready.get("num_ready_decode_workers", 0), ready.get("num_ready_prefill_workers", 0),
                           frozenset(pids))
