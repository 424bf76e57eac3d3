"""Failing loudly against a real nats-server: ``tandem join`` that cannot join exits with its
cause's code (3 unreachable, 4 TLS, 5 credentials refused, 7 its host name taken by another host)
and one line naming it, before any worker starts; a service whose login is refused on a reconnect
(the control plane restarted with a fresh password) exits at once with the line that says to copy
connect.env again, and a join whose worker is refused so stops with that line too."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from services.join.cli import EXIT_CODES
from services.join.identity import EXIT_HOST_NAME_TAKEN, EXIT_RELEASE_MISMATCH, load_host_id
from services.join.service import EXIT_NOT_READY
from services.stack.children import child_env
from services.stack.servers import free_port, start_nats_server
from services.stack.tls import server_tls
from shared.bus.bus import Bus
from shared.bus.errors import NatsCredentialsRefused, NatsTlsFailed, NatsUnreachable
from shared.bus.registry import WorkerRegistry
from shared.protocol.subjects import Subjects
from shared.protocol.workers import ServiceInfo, WorkerInfo
from shared.telemetry.redact import new_secret

PASSWORD = new_secret()
TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nats-tls")
    tls = server_tls(directory / "tls", ["127.0.0.1"])
    server = start_nats_server(directory / "nats", password=PASSWORD, tls=tls)
    yield server, tls.ca_file
    server.stop()


def join(tmp_path: Path, url: str, ca: Path | None = None) -> tuple[int, float, list[str], str]:
    connect = tmp_path / "connect.env"
    connect.write_text(f"TANDEM_NATS_URL={url}\nTANDEM_NAMESPACE=j{uuid.uuid4().hex[:8]}\n"
                       + (f"TANDEM_NATS_CA={ca}\n" if ca else ""))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "services.cli", "join", "--connect", str(connect),
                           "--decode", "1", "--ready-timeout-s", str(TIMEOUT_S), "--state-dir", str(tmp_path / "s")],
                          env=child_env({}), capture_output=True, text=True, timeout=60)
    return proc.returncode, time.monotonic() - started, proc.stderr.splitlines(), proc.stdout


def test_the_help_lists_the_exit_codes_the_errors_carry():
    for code, cause in ((NatsUnreachable.exit_code, "not reachable"), (NatsTlsFailed.exit_code, "TLS failed"),
                        (NatsCredentialsRefused.exit_code, "credentials refused"), (EXIT_NOT_READY, "not ready"),
                        (EXIT_HOST_NAME_TAKEN, "another host's workers are live"),
                        (EXIT_RELEASE_MISMATCH, "another Tandem release line")):
        assert f"; {code} " in EXIT_CODES and cause in EXIT_CODES.split(f"; {code} ")[1].split(";")[0], (code, cause)


def test_join_to_a_closed_port_exits_3_with_one_line_within_its_timeout(tmp_path):
    code, took_s, errors, out = join(tmp_path, f"nats://tandem:{PASSWORD}@127.0.0.1:{free_port()}")
    assert code == 3 and took_s < TIMEOUT_S + 15, (code, took_s, errors)
    assert len(errors) == 1 and "cannot reach NATS at nats://tandem:***@127.0.0.1:" in errors[0], errors
    assert PASSWORD not in errors[0] and "up " not in out, out


def test_join_with_another_ca_exits_4_at_once(tmp_path, tls_server):
    server, _ = tls_server
    wrong_ca = server_tls(tmp_path / "other", ["127.0.0.1"]).ca_file
    code, took_s, errors, _ = join(tmp_path, server.url, wrong_ca)
    assert code == 4 and took_s < TIMEOUT_S + 15, (code, took_s, errors)
    assert len(errors) == 1 and "TLS with NATS at tls://tandem:***@127.0.0.1:" in errors[0], errors
    assert "CERTIFICATE_VERIFY_FAILED" in errors[0] and "ca.pem" in errors[0], errors


def test_join_with_a_wrong_password_exits_5_at_once(tmp_path, tls_server):
    server, ca = tls_server
    code, took_s, errors, _ = join(tmp_path, server.url.replace(PASSWORD, "not-the-password"), ca)
    assert code == 5 and took_s < TIMEOUT_S + 15, (code, took_s, errors)
    assert len(errors) == 1 and "rejected the credentials" in errors[0], errors
    assert "copy connect.env from the control plane again" in errors[0] and "not-the-password" not in errors[0]


def test_a_service_refused_on_a_reconnect_exits_at_once_with_one_line(tmp_path):
    port = free_port()
    server = start_nats_server(tmp_path / "before", port=port, password=PASSWORD)
    env = {"TANDEM_NATS_URL": server.url, "TANDEM_NAMESPACE": f"r{uuid.uuid4().hex[:8]}"}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "admission"], env=child_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if "admission ready" in line:
                break
        server.stop()  # the control plane restarts, with a fresh password
        server = start_nats_server(tmp_path / "after", port=port, password=new_secret())
        code = proc.wait(timeout=30)
        lines += proc.stdout.read().splitlines()
    finally:
        proc.kill()
        server.stop()
    assert code == NatsCredentialsRefused.exit_code, "\n".join(lines)
    errors = [line for line in lines if "ERROR" in line]
    assert len(errors) == 1 and "rejected the credentials" in errors[0], "\n".join(lines)
    assert "copy connect.env from the control plane again" in errors[0], errors
    assert not any("Traceback" in line for line in lines), "\n".join(lines)


# -- two hosts under one host name (cloned machines) --------------------------------------------
REGISTRY_TTL_S = 30.0  # an entry put once stays live for the whole test
# the joined worker's own settings, through the environment it inherits: no warm-up to wait for
QUICK_WORKER = {"TANDEM_NUM_WARMUP_REQUESTS": "0", "TANDEM_WARMUP_PREFILL_RATE": "false"}


def write_connect(path: Path, url: str, namespace: str) -> Path:
    path.write_text(f"TANDEM_NATS_URL={url}\nTANDEM_NAMESPACE={namespace}\n"
                    f"TANDEM_REGISTRY_TTL_S={REGISTRY_TTL_S:g}\n")
    return path


def host_entry(namespace: str, host_id: str, **fields) -> WorkerInfo:
    """What a decode worker of host "twin" puts in the registry (a worker of the first host that
    joined under that name, or of an earlier run of this one)."""
    worker_id = f"{namespace}-twin-decode-1"
    return WorkerInfo(worker_id=worker_id, role="decode", model="smollm2-135m", block_size=16,
                      max_model_len=2048, generate_subject=f"{namespace}.v1.generate.{worker_id}",
                      host_id=host_id, **{"host": "twin", **fields})


async def put_entry(url: str, namespace: str, info: WorkerInfo) -> None:
    bus = await Bus.connect(url, "test-first-host")
    try:
        registry = await WorkerRegistry.open(bus, Subjects(namespace).workers_bucket, ttl_s=REGISTRY_TTL_S)
        await registry.put(info)
    finally:
        await bus.close()


async def registry_entries(url: str, namespace: str) -> list[WorkerInfo]:
    bus = await Bus.connect(url, "test-reader")
    try:
        registry = await WorkerRegistry.open(bus, Subjects(namespace).workers_bucket, ttl_s=REGISTRY_TTL_S)
        return await registry.list()
    finally:
        await bus.close()


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    server = start_nats_server(tmp_path_factory.mktemp("nats-plain") / "nats", password=PASSWORD)
    yield server
    server.stop()


def test_a_second_host_under_the_same_name_exits_7_naming_the_first_and_leaves_it_alone(tmp_path, plain_server):
    namespace = f"h{uuid.uuid4().hex[:8]}"
    first = host_entry(namespace, "f1f1f1f1f1f1f1f1", pid=4242, started_at=time.time() - 30, host="machine-a")
    asyncio.run(put_entry(plain_server.url, namespace, first))
    connect = write_connect(tmp_path / "connect.env", plain_server.url, namespace)
    proc = subprocess.run([sys.executable, "-m", "services.cli", "join", "--connect", str(connect), "--host-name",
                           "twin", "--decode", "1", "--state-dir", str(tmp_path / "clone")],
                          env=child_env({}), capture_output=True, text=True, timeout=60)
    errors = proc.stderr.splitlines()
    assert proc.returncode == EXIT_HOST_NAME_TAKEN, (proc.returncode, errors, proc.stdout)
    assert len(errors) == 1 and "another host already joined as 'twin'" in errors[0], errors
    assert f"{namespace}-twin-decode-1 (pid 4242 on machine-a, host id f1f1f1f1f1f1f1f1, last beat " in errors[0]
    assert "--host-name" in errors[0] and PASSWORD not in errors[0], errors
    assert "starting" not in proc.stdout, proc.stdout  # refused before any worker started
    (entry,) = asyncio.run(registry_entries(plain_server.url, namespace))
    assert entry.host_id == "f1f1f1f1f1f1f1f1" and entry.pid == 4242  # the first host's entry untouched


def test_a_control_plane_of_another_release_line_exits_8_before_any_worker_starts(tmp_path, plain_server):
    """The control plane's gateway says it runs 9.9.0: this host's release line is another one."""
    from shared.bus.services import ServiceDirectory

    namespace = f"v{uuid.uuid4().hex[:8]}"

    async def publish() -> None:
        bus = await Bus.connect(plain_server.url, "test-control-plane")
        try:
            directory = await ServiceDirectory.open(bus, Subjects(namespace).services_bucket, ttl_s=60)
            await directory.put(ServiceInfo(instance_id="gateway-cp-1", service="gateway", version="9.9.0",
                                            started_at=time.time(), heartbeat_at=time.time()))
        finally:
            await bus.close()

    asyncio.run(publish())
    connect = write_connect(tmp_path / "connect.env", plain_server.url, namespace)
    proc = subprocess.run([sys.executable, "-m", "services.cli", "join", "--connect", str(connect), "--decode", "1",
                           "--state-dir", str(tmp_path / "host")], env=child_env({}), capture_output=True,
                          text=True, timeout=60)
    errors = proc.stderr.splitlines()
    assert proc.returncode == EXIT_RELEASE_MISMATCH, (proc.returncode, errors, proc.stdout)
    assert len(errors) == 1 and "the control plane runs Tandem 9.9.0 and this host 0." in errors[0], errors
    assert "starting" not in proc.stdout, proc.stdout


class Lines:
    """A process's stdout, line by line, read on a thread; ``wait_for`` a line containing a text."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip())
                self._changed.notify_all()

    def wait_for(self, text: str, timeout_s: float) -> str | None:
        with self._changed:
            self._changed.wait_for(lambda: any(text in line for line in self.lines), timeout_s)
            return next((line for line in self.lines if text in line), None)

    def read_to_end(self, timeout_s: float) -> list[str]:
        """Every line, once the process closed its stdout (it exited)."""
        self._reader.join(timeout_s)
        return self.lines


@pytest.mark.slow
def test_a_join_restarted_on_its_state_dir_takes_its_entry_over_and_stops_when_refused_later(tmp_path,
                                                                                              smollm2_gguf):
    """The same host joining again (its crashed run's entry still live) is accepted, and counts as
    ready only once the worker it started registered, with its host id; when the control plane then
    restarts with a fresh password, the worker's login is refused and the join exits 5 with one
    line, instead of restarting the worker forever. About 15 s alone (one real worker loads the
    model, and gives up its login 5 s after the first refusal), over a minute on a busy machine."""
    port = free_port()
    server = start_nats_server(tmp_path / "before", port=port, password=PASSWORD)
    namespace = f"h{uuid.uuid4().hex[:8]}"
    state_dir = tmp_path / "host"
    host_id = load_host_id(state_dir / f"join-{namespace}")  # as this host's earlier run made it
    crashed_at = time.time()
    left = host_entry(namespace, host_id, pid=4242, started_at=crashed_at - 60)  # its crashed run's worker's
    asyncio.run(put_entry(server.url, namespace, left))
    connect = write_connect(tmp_path / "connect.env", server.url, namespace)
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "join", "--connect", str(connect),
                             "--host-name", "twin", "--decode", "1", "--state-dir", str(state_dir),
                             "--ready-timeout-s", "120", "--kv-cache-memory", "64MiB"],
                            env=child_env(QUICK_WORKER), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out = Lines(proc)
    try:
        assert out.wait_for("taken over by the workers starting now", 30), (out.lines, proc.poll())
        assert out.wait_for("ready:", 150), out.lines[-30:]
        (entry,) = asyncio.run(registry_entries(server.url, namespace))
        assert entry.host_id == host_id and entry.pid != 4242 and entry.started_at > crashed_at, entry
        server.stop()  # the control plane restarts, with a fresh password
        server = start_nats_server(tmp_path / "after", port=port, password=new_secret())
        code = proc.wait(timeout=60)
        errors = proc.stderr.read().splitlines()
        out.read_to_end(10)
    finally:
        proc.kill()
        server.stop()
    assert code == NatsCredentialsRefused.exit_code, (code, out.lines[-30:])
    assert len(errors) == 1, errors
    assert "decode-1 exited: the control plane's NATS refused the credentials" in errors[0], errors
    assert "copy connect.env from the control plane again" in errors[0], errors
    assert not any("restart 1 in" in line or "decode-1 restarted" in line for line in out.lines), out.lines[-30:]
