"""Failing loudly against a real nats-server: ``tandem join`` that cannot join exits with its
cause's code (3 unreachable, 4 TLS, 5 credentials refused) and one line naming it, before any
worker starts; a service whose login is refused on a reconnect (the control plane restarted with a
fresh password) exits at once with the line that says to copy connect.env again."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from services.join.cli import EXIT_CODES
from services.join.service import EXIT_NOT_READY
from shared.bus.errors import NatsCredentialsRefused, NatsTlsFailed, NatsUnreachable
from shared.stack.children import child_env
from shared.stack.servers import free_port, start_nats_server
from shared.stack.tls import server_tls
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
                        (NatsCredentialsRefused.exit_code, "credentials refused"), (EXIT_NOT_READY, "not ready")):
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
