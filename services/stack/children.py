"""Service child processes for ``tandem up`` and the integration tests.

Each child is ``python -m services.cli <service> ...`` in its own session (so a terminal's
Ctrl-C reaches only the parent, which then stops the children in order), dies with its parent
(Linux ``PR_SET_PDEATHSIG``), and has its output prefixed with its name, line by line.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux/glibc: the parent's stop() still cleans up
        pass


class Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str],
                 on_line: Callable[[str, str], None]) -> None:
        self.name = name
        self.argv = argv
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self._pump = threading.Thread(target=self._forward, args=(on_line,), name=f"{name}-output",
                                      daemon=True)
        self._pump.start()

    def _forward(self, on_line: Callable[[str, str], None]) -> None:
        for line in self.proc.stdout:
            on_line(self.name, line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        if self.is_running():
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.is_running():
            self.proc.kill()

    def wait(self, timeout_s: float) -> bool:
        """True when it exited within ``timeout_s``."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        self._pump.join(1.0)
        return True


# Settings that are or carry credentials: a child gets them in its environment, never on its command
# line, which every user of the machine can read (``ps``).
SECRET_SETTINGS = ("nats_url", "redis_url", "api_keys")


def split_secret_flags(flags: dict[str, object]) -> tuple[dict[str, object], dict[str, str]]:
    """``flags`` without the secret settings, and those settings as ``TANDEM_*`` variables."""
    env = {f"TANDEM_{name.upper()}": str(flags[name]) for name in SECRET_SETTINGS if flags.get(name)}
    return {k: v for k, v in flags.items() if k not in SECRET_SETTINGS}, env


# The stack starts ``tandem`` as a program, the same as a shell would: it imports no service.
TANDEM_ARGV = [sys.executable, "-m", "services.cli"]


def service_argv(service: str, flags: dict[str, object]) -> list[str]:
    argv = [*TANDEM_ARGV, service]
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):  # BooleanOptionalAction: --flag / --no-flag
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TQDM_DISABLE", "1")  # carriage-return progress bars garble prefixed logs
    env.update(extra or {})
    return env
