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

from shared.runtime.servers import free_port

pytestmark = pytest.mark.slow


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


def test_up_serves_then_ctrl_c_leaves_nothing_behind(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli.main", "up", "--port", str(port), "--namespace",
         f"up{uuid.uuid4().hex[:8]}", "--state-dir", str(tmp_path), "--kv-cache-memory", "128MiB",
         "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l.rstrip("\n")) for l in proc.stdout] + [lines.put(None)],
                     daemon=True).start()
    seen = []
    try:
        deadline = time.monotonic() + 180
        while not any(l.startswith("up") and "ready: http://" in l for l in seen):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "\n".join(seen[-30:])
            seen.append(line)
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
        deadline = time.monotonic() + 60
        while not any(l.startswith("up") and "admission restarted (restart 1, pid" in l for l in seen):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "\n".join(seen[-30:])
            seen.append(line)
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
