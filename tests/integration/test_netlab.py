"""The network lab itself: hosts as network namespaces, link cuts, the delay proxy, cleanup."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from delay_proxy import READY as PROXY_READY
from delay_proxy import proxy_argv
from netlab import Lab, available, list_namespaces, namespace_pids

from services.stack.servers import _binary

pytestmark = [pytest.mark.netns, pytest.mark.long]

NATS_PORT = 4222  # every host has its own port space

# run with the venv's python inside a host: "respond URL" answers on "echo" until killed;
# "request URL N" sends N requests and prints their round-trip times (s) as one JSON line
NATS_CLIENT = r"""
import asyncio, json, sys, time
import nats

async def main(mode, url, n=1):
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    if mode == "respond":
        async def echo(msg):
            await msg.respond(msg.data)
        await nc.subscribe("echo", cb=echo)
        await nc.flush()
        print("responding", flush=True)
        await asyncio.Event().wait()
    rtts = []
    for i in range(int(n)):
        t0 = time.monotonic()
        reply = await nc.request("echo", b"ping %d" % i, timeout=10)
        rtts.append(time.monotonic() - t0)
        assert reply.data == b"ping %d" % i, reply.data
    print(json.dumps(rtts), flush=True)
    await nc.close()

asyncio.run(main(*sys.argv[1:]))
"""

# "connect HOST PORT TIMEOUT": prints "ok" or the error's class and errno, exits 0 either way
TCP_CONNECT = r"""
import socket, sys
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    socket.create_connection((host, port), timeout=timeout).close()
    print("ok")
except OSError as e:
    print(type(e).__name__, e.errno)
"""


@pytest.fixture(autouse=True)
def _needs_netns():
    if (reason := available()) is not None:
        pytest.skip(reason)


@pytest.fixture
def lab():
    with Lab() as lab:
        yield lab


def start_nats(host):
    proc, _ = host.popen_ready([_binary("nats-server"), "-a", host.address, "-p", str(NATS_PORT)],
                               "Server is ready")
    return proc


def start_responder(host, url):
    proc, _ = host.popen_ready([sys.executable, "-c", NATS_CLIENT, "respond", url], "^responding")
    return proc


def request_rtts(host, url, n):
    out = host.run([sys.executable, "-c", NATS_CLIENT, "request", url, str(n)], timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def connect(host, address, port, timeout_s=1.0) -> str:
    out = host.run([sys.executable, "-c", TCP_CONNECT, address, str(port), str(timeout_s)], timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_hosts_talk_over_the_lab_network(lab):
    a, b, c = lab.add_host("a"), lab.add_host("b"), lab.add_host("c")
    assert len({a.address, b.address, c.address}) == 3
    start_nats(a)
    url = f"nats://{a.address}:{NATS_PORT}"
    start_responder(c, url)
    assert len(request_rtts(b, url, 3)) == 3
    # each host has a loopback of its own: a's server is not on b's 127.0.0.1
    assert connect(b, "127.0.0.1", NATS_PORT) == "ConnectionRefusedError 111"
    # and the machine's own namespace has none of the lab's addresses or interfaces
    own = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert f"10.213.{lab.octet}." not in own
    own_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert lab.run_id not in own_links


@pytest.mark.parametrize("at", ["host", "switch"])
def test_link_down_cuts_the_host_off(lab, at):
    a, b = lab.add_host("a"), lab.add_host("b")
    start_nats(a)
    assert connect(b, a.address, NATS_PORT) == "ok"
    b.link_down(at=at)
    t0 = time.monotonic()
    result = connect(b, a.address, NATS_PORT, timeout_s=1.0)
    if at == "host":  # no route any more: refused at once
        assert result.startswith("OSError"), result  # ENETUNREACH
        assert time.monotonic() - t0 < 5
    else:  # a pulled cable: nothing answers
        assert result.startswith(("TimeoutError", "OSError")), result
    assert connect(a, b.address, 9, timeout_s=0.5).startswith(("TimeoutError", "OSError"))
    b.link_up(at=at)
    assert connect(b, a.address, NATS_PORT) == "ok"


def test_delay_proxy_adds_latency_both_ways(lab):
    a, b, c = lab.add_host("a"), lab.add_host("b"), lab.add_host("c")
    start_nats(a)
    start_responder(c, f"nats://{a.address}:{NATS_PORT}")
    delay_ms = 150
    proxy, m = b.popen_ready(proxy_argv("127.0.0.1:0", f"{a.address}:{NATS_PORT}", delay_ms), PROXY_READY)
    port = int(m.group(2))
    rtts = request_rtts(b, f"nats://127.0.0.1:{port}", 3)
    # one proxy between b and a: the request is delayed once on its way, the reply once on its way back
    assert min(rtts) >= 2 * delay_ms / 1000, rtts
    proxy.send_signal(signal.SIGTERM)
    assert proxy.wait(10) == 0, proxy.lines


def test_kill_all_leaves_no_process(lab):
    c = lab.add_host("c")
    started = [c.popen(["sleep", "600"]) for _ in range(2)]
    # and one we did not start ourselves: a grandchild in a session of its own
    c.run(["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 &"])
    assert len(c.pids()) >= 3
    c.kill_all()
    assert c.pids() == []
    assert [p.returncode for p in started] == [-signal.SIGKILL] * 2


def test_close_removes_every_namespace_of_the_run():
    lab = Lab()
    a = lab.add_host("a")
    lab.add_host("b")
    a.popen(["sleep", "600"])
    assert len(lab.namespaces()) == 3  # the switch and two hosts
    lab.close()
    assert [ns for ns in list_namespaces() if ns.startswith(lab.run_id)] == []
    lab.close()  # idempotent


def test_leftovers_of_a_dead_run_are_swept():
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs stands for a test process that was SIGKILLed
    stale = f"netlab-{gone.pid}-abc123-x"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
        deadline = time.monotonic() + 5
        while not namespace_pids(stale) and time.monotonic() < deadline:
            time.sleep(0.02)
        with Lab() as lab:
            assert stale not in list_namespaces()
            assert sleeper.wait(5) == -signal.SIGKILL
            assert lab.run_id not in stale
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
