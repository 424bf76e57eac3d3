"""The faults the chaos drill injects into a running ``Stack``, one at a time.

Each fault is a function of the stack that returns notes on what it did; it blocks for as long as
the fault lasts (a SIGSTOP lasts ``stop_s``; a server restart until the server is back), so the
drill runs it in a thread while the load goes on. ``skip_reason`` says why a fault cannot be
injected into this stack (e.g. killing one of two gateways in a stack that has one).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from loadtest.tools.harness import status
from services.stack.servers import ServerProcess
from services.stack.stack import Stack


@dataclass(frozen=True)
class FaultOptions:
    stop_s: float = 10.0          # how long a SIGSTOPped worker stays stopped
    server_grace_s: float = 3.0   # a killed server that is not back by then is restarted by the drill


FAULTS: dict[str, str] = {
    "none": "no fault (control: shows what the load does on its own)",
    "kill-decode": "SIGKILL of a decode worker",
    "kill-prefill": "SIGKILL of a prefill worker",
    "kill-admission": "SIGKILL of admission",
    "kill-kv-index": "SIGKILL of kv-index",
    "kill-autoscaler": "SIGKILL of the autoscaler",
    "kill-gateway": "SIGKILL of one of two gateways",
    "stop-decode": "SIGSTOP of a decode worker, SIGCONT after --stop-s",
    # Redis before NATS: a stack that does not ride through a NATS restart ends the drill
    "restart-redis": "redis-server SIGKILLed and started again",
    "restart-nats": "nats-server SIGKILLed and started again",
}

_TARGETS = {"kill-decode": "decode", "kill-prefill": "prefill", "kill-admission": "admission",
            "kill-kv-index": "kv-index", "kill-autoscaler": "autoscaler", "kill-gateway": "gateway",
            "stop-decode": "decode"}
_SERVERS = {"restart-nats": "nats-server", "restart-redis": "redis-server"}


def _children(stack: Stack, prefix: str) -> list[str]:
    return sorted(n for n in stack.children if n == prefix or n.startswith(prefix + "-"))


def _server(stack: Stack, name: str) -> ServerProcess | None:
    return next((s for s in stack.servers if s.name == name), None)


def skip_reason(fault: str, stack: Stack) -> str | None:
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    if fault == "kill-gateway" and len(_children(stack, "gateway")) < 2:
        return "needs --gateways 2"
    if fault in _TARGETS and not _children(stack, _TARGETS[fault]):
        return f"the stack runs no {_TARGETS[fault]}"
    if fault in _SERVERS and _server(stack, _SERVERS[fault]) is None:
        return f"needs an embedded {_SERVERS[fault]} (the stack was given its URL)"
    return None


def inject(fault: str, stack: Stack, options: FaultOptions) -> list[str]:
    """Do ``fault`` to ``stack``; notes on what was done. Call only when ``skip_reason`` is None."""
    if fault == "none":
        return []
    if fault == "stop-decode":
        return _stop(stack, _busiest(stack, "decode"), options.stop_s)
    if fault in _SERVERS:
        return _restart_server(stack, _SERVERS[fault], options.server_grace_s)
    return _kill(stack, _busiest(stack, _TARGETS[fault]))


def _busiest(stack: Stack, prefix: str) -> str:
    """Of the children named ``prefix``, the worker running the most requests by its last load report
    (so that a fault hits work in flight), else the first."""
    names = _children(stack, prefix)
    try:
        running = {w["info"]["worker_id"]: (w.get("load") or {}).get("num_running", 0)
                   for w in status(stack.base_url, timeout_s=5)["workers"]}
    except (OSError, ValueError):
        return names[0]
    return max(names, key=lambda n: running.get(f"{stack.spec.namespace}-{n}"[:64], 0))


def _kill(stack: Stack, name: str) -> list[str]:
    child = stack.children[name]
    child.proc.send_signal(signal.SIGKILL)
    return [f"SIGKILL {name} (pid {child.pid})"]


def _stop(stack: Stack, name: str, stop_s: float) -> list[str]:
    pid = stack.children[name].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(stop_s)  # the fault itself: a worker that hangs this long
    finally:
        os.kill(pid, signal.SIGCONT)
    return [f"SIGSTOP {name} (pid {pid}) for {stop_s:g}s"]


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait(predicate: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until ``predicate`` held, or None if it did not within ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def _restart_server(stack: Stack, name: str, grace_s: float) -> list[str]:
    """SIGKILL the server; if nothing brings it back on its port within ``grace_s``, start it again
    (same port, data directory and password) in place of the old one in ``stack.servers``."""
    server = _server(stack, name)
    port = urlsplit(server.url).port
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    killed = time.monotonic()
    notes = [f"SIGKILL {name} (pid {server.proc.pid}, port {port})"]
    if (back_s := _wait(lambda: _accepts(port), grace_s)) is not None:
        return notes + [f"{name} back by itself after {back_s:.1f}s"]
    server.restart()
    return notes + [f"{name} restarted by the drill after {time.monotonic() - killed:.1f}s (pid {server.pid})"]
