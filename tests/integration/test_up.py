"""``tandem up`` end to end: embedded servers and every service as processes, the base URL printed
when ready, a streamed reply, a SIGKILLed admission restarted by the supervisor, then SIGINT
(Ctrl-C) stops everything, the restarted process included, and leaves no process."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from services.stack.servers import free_port
from stack_helpers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long]


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_up(*args: str) -> tuple[subprocess.Popen, queue.Queue]:
    """``tandem up ARGS`` in its own session, and a queue of its output lines (None at its end)."""
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l.rstrip("\n")) for l in proc.stdout] + [lines.put(None)],
                     daemon=True).start()
    return proc, lines


def read_until(lines: queue.Queue, seen: list[str], wanted, timeout_s: float) -> None:
    """Move output lines into ``seen`` until one of them is ``wanted(line)``; fails (with the last
    lines) if the output ends first, and raises ``queue.Empty`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not any(wanted(l) for l in seen):
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line is not None, "\n".join(seen[-30:])
        seen.append(line)


def is_ready_line(line: str) -> bool:
    return line.startswith("up") and "ready: http://" in line


def test_up_serves_then_ctrl_c_leaves_nothing_behind(tmp_path):
    port = free_port()
    proc, lines = start_up("--port", str(port), "--namespace", f"up{uuid.uuid4().hex[:8]}", "--state-dir",
                           str(tmp_path), "--kv-cache-memory", "128MiB", "--device", "cpu")
    seen = []
    try:
        read_until(lines, seen, is_ready_line, 180)
        assert f"http://127.0.0.1:{port}" in seen[-1]
        processes = descendants(proc.pid)
        assert len(processes) >= 7  # nats, redis, gateway, admission, kv-index, autoscaler, decode

        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "smollm2-135m", "stream": True, "max_tokens": 8,
                                                      "messages": [{"role": "user", "content": "Hi"}]}).encode())
        with urllib.request.urlopen(req, timeout=60) as resp:
            body = resp.read().decode()
        assert body.rstrip().endswith("data: [DONE]") and '"content"' in body

        admission = next(p for p in processes if b"admission" in Path(f"/proc/{p}/cmdline").read_bytes())
        os.kill(admission, signal.SIGKILL)
        read_until(lines, seen, lambda l: l.startswith("up") and "admission restarted (restart 1, pid" in l, 60)
        assert any("admission exited (signal SIGKILL)" in l for l in seen)
        processes = descendants(proc.pid)
        assert admission not in processes and len(processes) >= 7
    finally:
        proc.send_signal(signal.SIGINT)
        stopped_at = time.monotonic()
        proc.wait(30)
    assert time.monotonic() - stopped_at < 20
    assert proc.returncode == 0
    assert [p for p in processes if alive(p)] == []
    names = {l.split("|", 1)[0].strip() for l in seen if "|" in l}
    assert {"nats", "redis", "gateway", "admission", "kv-index", "autoscaler", "decode-1", "up"} <= names


def test_up_with_no_workers_serves_a_worker_of_your_own(tmp_path):
    """``--decode 0``: the control plane alone. The ready line names the servers (passwords masked)
    and the owner-only file holding the real URLs; the documented echo worker, started from that
    file, serves through the gateway, shows in ``tandem status``, and on SIGTERM drains and leaves."""
    port, namespace = free_port(), f"up{uuid.uuid4().hex[:8]}"
    proc, lines = start_up("--decode", "0", "--port", str(port), "--namespace", namespace, "--state-dir",
                           str(tmp_path), "--registry-ttl-s", "15")
    seen: list[str] = []
    worker = None
    base = f"http://127.0.0.1:{port}"
    try:
        read_until(lines, seen, is_ready_line, 120)
        ready = seen[-1]
        assert "NATS nats://" in ready and "Redis redis://" in ready and "***@127.0.0.1:" in ready, ready
        connect = tmp_path / namespace / "connect.env"
        assert f"credentials in {connect}" in ready
        assert connect.stat().st_mode & 0o777 == 0o600
        env = dict(line.split("=", 1) for line in connect.read_text().splitlines())
        assert env["TANDEM_NAMESPACE"] == namespace and env["TANDEM_NATS_URL"].startswith("nats://")
        assert env["TANDEM_NATS_URL"] not in "\n".join(seen)  # the password itself is never printed
        assert "TANDEM_REDIS_URL" not in env  # loopback only: nothing another host could use

        example = Path(__file__).resolve().parents[2] / "docs" / "examples" / "echo_worker.py"
        worker = subprocess.Popen([sys.executable, str(example), "--worker-id", "echo-byo", "--ttl", "15"],
                                  env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        assert "serving" in worker.stdout.readline()
        wait_for(lambda: _ready(base), 30, "the echo worker to make /ready 200")
        req = urllib.request.Request(base + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": "Hello tandem", "max_tokens": 5}).encode())
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.headers["X-Tandem-Worker"] == "echo-byo"
            assert json.load(resp)["usage"]["completion_tokens"] == 5
        assert env["TANDEM_GATEWAY_URL"] == base  # so that `tandem status` finds a gateway off port 8000

        def status_listing_echo() -> str | None:  # no --url: from connect.env's TANDEM_GATEWAY_URL
            status = subprocess.run([sys.executable, "-m", "services.cli", "status"], env={**os.environ, **env},
                                    capture_output=True, text=True, timeout=30)
            assert status.returncode == 0, status.stderr
            return status.stdout if "echo-byo" in status.stdout else None

        # the autoscaler's view, which /status shows, refreshes on its own
        listing = wait_for(status_listing_echo, 20, "echo-byo in tandem status")
        assert "NATS: nats://" in listing and "Redis: redis://" in listing and "***@" in listing

        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        assert "drained and deregistered" in worker.stdout.read()
        # deleted: left to expire it would stay 10-15 s (TTL 15 s, beat 5 s)
        wait_for(lambda: not _ready(base) and "echo-byo" not in _listed_workers(base), 8,
                 "the echo worker gone from /ready and /status after it left")
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert proc.returncode == 0


def _listed_workers(base: str) -> list[str]:
    with urllib.request.urlopen(base + "/status", timeout=5) as resp:
        return [w["info"]["worker_id"] for w in json.load(resp)["workers"]]


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/ready", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False
