"""``tandem join`` re-reads its connect file while it runs.

After ``tandem credentials rotate`` on the control plane, an operator (or a config-management run)
copies the new ``connect.env`` over the old one on each joined host, within the rotation's overlap
window. The join notices the new file, checks that the control plane's NATS takes its login, and
restarts its workers one at a time with it, each once the one before is registered again; a file
that cannot be read or whose login is refused is reported and the running workers are left as they
are (they still hold a login the overlap window accepts). Only the NATS URL and CA are taken over
this way; a change of namespace or registry TTL says to restart ``tandem join``.

Restarts run on the main thread (a child dies with the thread that started it); the wait for a
restarted worker's registration runs on a thread of its own, so the main loop keeps answering
Ctrl-C and watching its workers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

from services.framework.errors import CliError
from services.stack.stack import Stack, print_line

CHECK_INTERVAL_S = 2.0
APPLIED_KEYS = ("TANDEM_NATS_URL", "TANDEM_NATS_CA")


@dataclasses.dataclass
class _Roll:
    pending: list[str]
    registered: threading.Event | None = None  # the last restarted worker's registration (or its wait's end)


class ConnectWatch:
    def __init__(self, stack: Stack, path: Path, current: dict[str, str], read: Callable[[Path], dict[str, str]],
                 check_login: Callable[[str, str | None], None],
                 wait_registered: Callable[[str, float], None], drain_timeout_s: float) -> None:
        """``read``: the connect file's values (raises ``CliError``); ``check_login(url, ca)``: raises
        ``CliError`` when NATS refuses them; ``wait_registered(worker_id, started_at)``: blocks until
        that worker's registry entry is newer than ``started_at`` (raises on timeout)."""
        self.stack, self.path, self.current = stack, path, dict(current)
        self._read, self._check_login, self._wait_registered = read, check_login, wait_registered
        self._drain_timeout_s = drain_timeout_s
        self._digest = self._file_digest()
        self._next_check_s = 0.0
        self._roll: _Roll | None = None
        self.num_applied = 0  # new connect files taken over

    def poll(self, now_s: float) -> None:
        """From the join's main loop: go on with a rolling restart, or look at the file again."""
        if self._roll is not None:
            self._roll_next()
            return
        if now_s < self._next_check_s:
            return
        self._next_check_s = now_s + CHECK_INTERVAL_S
        digest = self._file_digest()
        if digest is None or digest == self._digest:
            return
        self._digest = digest
        try:
            values = self._read(self.path)
        except CliError as exc:
            self._say(f"{self.path} changed but cannot be used ({exc}): the workers keep their login")
            return
        ignored = sorted(k for k in set(values) | set(self.current)
                         if k not in APPLIED_KEYS and values.get(k) != self.current.get(k))
        if ignored:
            self._say(f"{self.path}: {', '.join(ignored)} changed: restart tandem join to apply "
                      f"{'it' if len(ignored) == 1 else 'them'}")
        if all(values.get(k) == self.current.get(k) for k in APPLIED_KEYS):
            return
        url, ca = values["TANDEM_NATS_URL"], values.get("TANDEM_NATS_CA")
        try:
            self._check_login(url, ca)
        except CliError as exc:
            self._say(f"{self.path} changed, but its NATS login does not work ({exc}): the workers keep theirs")
            return
        self.current = {**self.current, **{k: values[k] for k in APPLIED_KEYS if k in values}}
        self.stack.use_nats(url, ca)
        self.num_applied += 1
        names = self.stack.rolling_order()
        self._say(f"{self.path} has a new NATS login, accepted: restarting {', '.join(names)} with it, one at a time")
        self._roll = _Roll(names)

    def _roll_next(self) -> None:
        roll = self._roll
        if roll.registered is not None and not roll.registered.is_set():
            return
        if not roll.pending:
            self._roll = None
            self._say("every worker of this host runs with the new NATS login")
            return
        name = roll.pending.pop(0)
        started_at = time.time()
        if self.stack.restart_child(name, self._drain_timeout_s) is None:  # the join is stopping
            self._roll = None
            return
        roll.registered = threading.Event()
        threading.Thread(target=self._await, args=(name, started_at, roll.registered), daemon=True).start()

    def _await(self, name: str, started_at: float, done: threading.Event) -> None:
        try:
            self._wait_registered(self.stack.worker_id(name), started_at)
        except Exception as exc:  # noqa: BLE001 - reported; the roll goes on to the next worker
            self._say(f"{name} did not register again in time ({exc}); going on")
        finally:
            done.set()

    def _file_digest(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def _say(self, line: str) -> None:
        print_line("join", line)

