"""Credentials on every hop, against real servers that require them: a wrong or missing NATS
password and a missing Redis password are one-line errors naming the server (password redacted),
from the library calls and from real service processes; and ``Stack`` (``tandem up``) with fresh
generated passwords serves a request without showing them on any command line or output line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
from stack_helpers import environ_nats_url, running_stack

from services.stack.children import child_env
from services.stack.servers import start_nats_server, start_redis_server
from services.stack.stack import StackSpec
from shared.bus import Bus
from shared.store import check_connection, connect
from shared.telemetry.redact import new_secret

PASSWORD = new_secret()


@pytest.fixture(scope="module")
def nats_locked(tmp_path_factory):
    server = start_nats_server(tmp_path_factory.mktemp("nats-auth"), password=PASSWORD)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_locked(tmp_path_factory):
    server = start_redis_server(tmp_path_factory.mktemp("redis-auth"), password=PASSWORD)
    yield server
    server.stop()


def without_password(url: str) -> str:
    return url.replace(f":{PASSWORD}@", "@").replace("redis://@", "redis://")


def one_line_error(exc: BaseException, shown_url: str) -> str:
    message = str(exc)
    assert "\n" not in message and PASSWORD not in message, message
    assert shown_url in message, message
    return message


async def test_nats_with_the_password_works_and_without_or_with_a_wrong_one_fails_at_once(nats_locked):
    port = nats_locked.url.rsplit(":", 1)[1]
    bus = await Bus.connect(nats_locked.url, "test")
    try:
        assert await bus.nc.rtt() >= 0
    finally:
        await bus.close()
    wrong = nats_locked.url.replace(PASSWORD, "not-the-password")
    for url, shown in ((wrong, f"nats://tandem:***@127.0.0.1:{port}"),
                       # user-info without a colon is a token to NATS, so all of it is hidden
                       (without_password(nats_locked.url), f"nats://***@127.0.0.1:{port}")):
        with pytest.raises(ConnectionError) as caught:
            # a deadline this long is never reached: the rejection ends the attempt
            await Bus.connect(url, "test", timeout_s=120)
        message = one_line_error(caught.value, shown)
        assert "rejected the credentials" in message and "not-the-password" not in message


async def test_redis_without_or_with_a_wrong_password_is_a_clear_error(redis_locked):
    port = redis_locked.url.rsplit(":", 1)[1].split("/")[0]
    client = connect(redis_locked.url)
    await check_connection(client, redis_locked.url)
    assert await client.set("credentials-test", "1")
    await client.aclose()
    cases = ((without_password(redis_locked.url), "requires a password and the URL carries none"),
             (redis_locked.url.replace(PASSWORD, "not-the-password"), "rejected the password"))
    for url, why in cases:
        client = connect(url)
        with pytest.raises(ConnectionError) as caught:
            await check_connection(client, url)
        await client.aclose()
        message = one_line_error(caught.value, f"127.0.0.1:{port}/0")
        assert why in message and "not-the-password" not in message


def run_service(service: str, env: dict[str, str]) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "services.cli", service], env=child_env(env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    return proc.returncode, proc.stdout.splitlines()


@pytest.mark.parametrize("service,server,why", [
    ("admission", "nats", "NATS at nats://tandem:***@127.0.0.1:{port} rejected the credentials: "
                          "nats: 'Authorization Violation'; on a joined host copy connect.env from the control "
                          "plane again (tandem up keeps its password across restarts unless its state directory is "
                          "wiped)"),
    ("kv-index", "redis", "Redis at redis://127.0.0.1:{port}/0 requires a password and the URL carries none"),
])
def test_a_service_refused_by_its_server_exits_with_one_line_naming_it(
        service, server, why, nats_locked, redis_locked):
    locked = nats_locked if server == "nats" else redis_locked
    port = locked.url.rsplit(":", 1)[1].split("/")[0]
    env = {"TANDEM_NATS_URL": nats_locked.url.replace(PASSWORD, "not-the-password"),
           "TANDEM_REDIS_URL": without_password(redis_locked.url),
           "TANDEM_NAMESPACE": f"c{uuid.uuid4().hex[:8]}"}
    code, lines = run_service(service, env)
    assert code == (5 if server == "nats" else 1), "\n".join(lines)  # 5: NatsCredentialsRefused
    errors = [line for line in lines if "ERROR" in line or "WARNING" in line]
    assert len(errors) == 1 and errors[0].endswith(why.format(port=port)), "\n".join(lines)
    assert not any("Traceback" in line or "not-the-password" in line for line in lines), "\n".join(lines)


@pytest.mark.slow
@pytest.mark.long
def test_stack_generates_credentials_and_serves_without_showing_them(tmp_path):
    spec = StackSpec(state_dir=tmp_path, num_decode=1, port=0, namespace=f"c{uuid.uuid4().hex[:8]}",
                     decode_flags={"max_model_len": 1024, "kv_cache_memory": "128MiB", "device": "cpu",
                                   "num_warmup_requests": 1})
    with running_stack(spec, ready_timeout_s=240) as stack:
        secrets = [_password(tmp_path / "nats" / "nats.conf", "password"),
                   _password(tmp_path / "redis" / "auth.conf", "requirepass")]
        assert secrets[0] != secrets[1] and secrets[0] in stack.nats_url and secrets[1] in stack.redis_url
        body = json.dumps({"model": "smollm2-135m", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "Hi"}]}).encode()
        req = urllib.request.Request(stack.base_url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert json.load(resp)["choices"][0]["message"]["content"]
        with urllib.request.urlopen(stack.base_url + "/status", timeout=10) as resp:
            status = resp.read().decode()
        pids = [c.pid for c in stack.children.values()] + [s.proc.pid for s in stack.servers]
        cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") for pid in pids]
        for secret in secrets:
            assert not any(secret in c for c in cmdlines), cmdlines
            assert not any(secret in line for line in stack.lines), "a password in the stack's output"
            assert secret not in status
    assert any("kv-index" in c for c in cmdlines) and len(cmdlines) == len(pids)


def _password(conf: Path, key: str) -> str:
    assert conf.stat().st_mode & 0o077 == 0, f"{conf} is readable by others"
    found = re.search(rf'\b{key}\b:?\s*("(?:[^"\\]|\\.)*")', conf.read_text())
    assert found, f"no {key} in {conf}"
    return json.loads(found.group(1))


@pytest.mark.parametrize("members", [1, 3])
async def test_a_restarted_control_planes_nats_takes_back_its_login_and_ports(tmp_path, members):
    """Hosts joined with the last run's connect.env log in again after ``tandem up`` restarts:
    the embedded NATS keeps its password and client ports (the file only its owner reads); a port
    taken meanwhile gets a new one, with a line saying joined hosts need the new connect.env."""
    from services.stack.stack import Stack

    spec = StackSpec(state_dir=tmp_path, nats_cluster=members, namespace=f"k{uuid.uuid4().hex[:6]}")
    urls, lines = [], []
    for _ in range(2):
        stack = Stack(spec, on_line=lambda name, line: lines.append(line))
        stack._start_nats()
        try:
            urls.append(stack.nats_url)
            bus = await Bus.connect(stack.nats_url, "joined")  # the URL a joined host keeps in connect.env
            await bus.close()
        finally:
            for server in stack.servers:
                server.stop()
    assert urls[0] == urls[1]
    assert (tmp_path / "nats" / "login.json").stat().st_mode & 0o777 == 0o600
    blocker = __import__("socket").socket()
    blocker.bind(("127.0.0.1", int(urls[0].split(",")[0].rsplit(":", 1)[1])))
    blocker.listen()
    try:
        stack = Stack(spec, on_line=lambda name, line: lines.append(line))
        stack._start_nats()
        for server in stack.servers:
            server.stop()
    finally:
        blocker.close()
    assert stack.nats_url != urls[0] and stack.nats_url.split("@")[0] == urls[0].split("@")[0]  # same login
    assert any("need this run's connect.env" in line for line in lines)


def _credentials(stack, rotator, *argv: str) -> int:
    """``tandem credentials ...`` against ``stack``'s state dir, served by ``rotator`` as tandem up's
    main loop serves it."""
    import threading
    import time

    from services.cli import main

    spec = stack.spec
    codes = []
    command = threading.Thread(target=lambda: codes.append(main(
        ["credentials", *argv, "--state-dir", str(spec.state_dir.parent), "--namespace", spec.state_dir.name,
         "--answer-timeout-s", "20"])))
    command.start()
    while command.is_alive():
        rotator.poll(time.time())
        time.sleep(0.05)
    return codes[0]


async def _logs_in(url: str) -> bool:
    try:
        bus = await Bus.connect(url, "rotation", timeout_s=10)
    except ConnectionError as exc:
        assert "rejected the credentials" in str(exc), exc
        return False
    await bus.close()
    return True



@pytest.mark.parametrize("members", [1, 3])
async def test_a_rotated_nats_login_overlaps_then_only_the_new_one_logs_in(tmp_path, members):
    """``tandem credentials rotate`` against a running stack: both logins work for the overlap,
    connect.env and login.json carry the new one, the stack's own service is restarted with it (and
    survives the old one's end); ``finish`` (or the overlap's end) leaves the new one alone; a
    restart keeps it."""
    import time

    from services.stack.rotate import KeptLogin, Rotator
    from services.stack.stack import Stack
    from services.up.service import write_connect_file

    namespace = f"k{uuid.uuid4().hex[:6]}"
    spec = StackSpec(state_dir=tmp_path / namespace, nats_cluster=members, namespace=namespace)
    lines = []
    stack = Stack(spec, on_line=lambda name, line: lines.append(f"{name}| {line}"))
    rotator = Rotator(stack, lambda: write_connect_file(stack), new_secret)
    try:
        stack._start_nats()
        old_url = stack.nats_url
        child = stack.spawn("admission", "admission", stack._bus_flags()) if members == 1 else None
        assert _credentials(stack, rotator, "rotate", "--overlap-s", "600") == 0
        new_url = stack.nats_url
        assert new_url != old_url and await _logs_in(old_url) and await _logs_in(new_url)
        assert f"TANDEM_NATS_URL={new_url}\n" in (spec.state_dir / "connect.env").read_text()
        kept = KeptLogin.load(spec.state_dir / "nats", members)
        assert [l.user for l in kept.logins] == ["tandem-2", "tandem"] and kept.old_until_s > time.time() + 500
        assert _credentials(stack, rotator, "rotate") == 1  # one rotation at a time
        while rotator.is_rolling:  # as tandem up's main loop: this host's services, one at a time
            rotator.poll(time.time())
            time.sleep(0.1)
        if child is not None:
            restarted = stack.children["admission"]
            shown = "\n".join(line for line in lines if "nats|" not in line)
            assert restarted.is_running() and restarted.pid != child.pid, shown
            assert environ_nats_url(restarted.pid) == new_url
        assert _credentials(stack, rotator, "finish") == 0
        assert await _logs_in(new_url) and not await _logs_in(old_url)
        assert KeptLogin.load(spec.state_dir / "nats", members).logins == kept.logins[:1]
        # again, the old login ending with the overlap: back to the first user name
        assert _credentials(stack, rotator, "rotate", "--overlap-s", "5") == 0
        third_url = stack.nats_url
        while rotator.is_rolling:  # the old login goes once this host's services have the new one
            rotator.poll(time.time() + 6)
            time.sleep(0.1)
        rotator.poll(time.time() + 6)
        assert await _logs_in(third_url) and not await _logs_in(new_url) and "tandem:" in third_url
        if child is not None:
            assert stack.children["admission"].is_running(), "\n".join(lines[-30:])
    finally:
        stack.stop()
    stack = Stack(spec, on_line=lambda name, line: lines.append(line))
    stack._start_nats()
    try:
        assert stack.nats_url == third_url and await _logs_in(third_url)
    finally:
        stack.stop()
