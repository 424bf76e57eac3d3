"""The ports KV traffic listens on can be planned for a firewall: a worker's NIXL agent (UCX over
TCP) takes its listening ports from ``UCX_TCP_PORT_RANGE`` and its interfaces from
``UCX_NET_DEVICES``, which every process ``tandem up`` and ``tandem join`` start inherits
(``services.stack.children.child_env``), as docs/running.md tells operators."""

import subprocess
import sys

from services.stack.children import child_env

PROBE = r"""
import os
from shared.transfer.nixl import NixlTransfer

agent = NixlTransfer("port-probe")
mine = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if link.startswith("socket:["):
        mine.add(link[8:-1])
for proto in ("tcp", "tcp6"):
    for line in open(f"/proc/net/{proto}").read().splitlines()[1:]:
        f = line.split()
        if f[9] in mine and f[3] == "0A":  # LISTEN
            print("listen", f[1].rsplit(":", 1)[0], int(f[1].rsplit(":", 1)[1], 16))
agent.close()
"""


def listening(env: dict[str, str]) -> list[tuple[str, int]]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [(host, int(port)) for _, host, port in (line.split() for line in out.stdout.splitlines()
                                                    if line.startswith("listen "))]


def test_a_worker_listens_for_kv_in_the_port_range_and_on_the_interface_it_is_given(monkeypatch):
    monkeypatch.setenv("UCX_TCP_PORT_RANGE", "47100-47199")
    ports = listening(child_env())
    assert ports and all(47100 <= port <= 47199 for _, port in ports), ports
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    ports = listening(child_env())
    assert ports and {host for host, _ in ports} == {"0100007F"}, ports  # 127.0.0.1 alone
    assert all(47100 <= port <= 47199 for _, port in ports)
