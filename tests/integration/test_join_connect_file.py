"""A running ``tandem join`` takes over a new connect.env copied over its own (after a credentials
rotation on the control plane): its worker restarts with the new login within the overlap window,
registers again, and keeps serving after the old login is dropped; nothing needs restarting by hand."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid

import pytest

from services.stack.children import child_env
from services.stack.servers import Login, start_nats_server, with_login
from shared.telemetry.redact import new_secret
from stack_helpers import environ_nats_url
from test_join_failures import QUICK_WORKER, Lines, registry_entries, write_connect



@pytest.mark.slow
def test_a_new_connect_file_is_taken_over_without_restarting_the_join(tmp_path, smollm2_gguf):
    """Over a minute on 2 cores: the worker loads the model twice (before and after the new login)."""
    old, new = Login("tandem", new_secret()), Login("tandem-2", new_secret())
    server = start_nats_server(tmp_path / "nats", password=old.password)
    namespace = f"c{uuid.uuid4().hex[:8]}"
    connect = write_connect(tmp_path / "connect.env", server.url, namespace)
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "join", "--connect", str(connect),
                             "--host-name", "rotating", "--decode", "1", "--state-dir", str(tmp_path / "host"),
                             "--ready-timeout-s", "150", "--kv-cache-memory", "64MiB"],
                            env=child_env(QUICK_WORKER), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = Lines(proc)
    try:
        assert out.wait_for("ready:", 180), out.lines[-30:]
        (before,) = asyncio.run(registry_entries(server.url, namespace))
        server.set_logins([new, old])  # tandem credentials rotate: both accepted for the overlap
        new_url = with_login(server.url, new)
        write_connect(connect, new_url, namespace)  # the operator copies the new connect.env over the old
        assert out.wait_for("has a new NATS login, accepted", 30), out.lines[-30:]
        assert out.wait_for("every worker of this host runs with the new NATS login", 240), out.lines[-30:]
        (after,) = asyncio.run(registry_entries(new_url, namespace))
        assert after.pid != before.pid and after.started_at > before.started_at
        assert environ_nats_url(after.pid) == new_url
        server.set_logins([new])  # the overlap ends: the old login is dropped
        time.sleep(8)  # longer than a refused worker takes to give up (5 s)
        assert proc.poll() is None, (proc.returncode, out.lines[-30:])
        (still,) = asyncio.run(registry_entries(new_url, namespace))
        assert still.pid == after.pid
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        server.stop()
