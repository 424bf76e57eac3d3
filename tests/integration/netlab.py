"""Hosts as Linux network namespaces of this machine, joined by a bridge in a namespace of its own.

    with Lab() as lab:
        a, b = lab.add_host("a"), lab.add_host("b")
        server = a.popen_ready([nats, "-a", a.address, "-p", "4222"], "Server is ready")
        b.run([sys.executable, "client.py", f"nats://{a.address}:4222"])
        b.link_down(); ...; b.link_up()
        a.kill_all()                      # the host vanishes: every process in it gets SIGKILL

Layout of one lab (``<run>`` is ``netlab-<creator pid>-<random hex>``, unique per Lab):

    namespace <run>-sw      bridge ``br0`` and one veth end ``p<i>`` per host, no addresses
    namespace <run>-<name>  ``lo`` up, veth end ``eth0`` with ``10.213.<X>.<i>/24``

Everything is created inside these namespaces (``ip -n NS link add ... peer ... netns HOST``), so
no interface, address or route of the machine's own (root) namespace is touched, and nothing in a
lab has a route out of it: a lab can reach only itself. ``X`` is drawn per run; two labs on one
machine are separate layer-2 domains anyway, so even an equal ``X`` could not collide.

Only the network stack is separate: a process in a host shares the file system (``/dev/shm`` and
path-named Unix sockets included), the PID space and System V IPC with every other process of the
machine. UCX (NIXL's backend) sees two hosts of a lab as one node (the same boot id and IPC
namespace): checked here, a NIXL write between hosts ``a`` and ``b`` put its active messages on
``tcp/eth0`` (the lab network) but the DRAM payload through ``cma`` (process_vm_writev), past any
link cut or delay proxy. ``UCX_NETWORK_ONLY`` in a process's environment makes it ``tcp`` only
(``inter-node``, everything on ``eth0``); on GPUs add ``cuda_copy`` (``UCX_TLS=tcp,cuda_copy``).
Processes keep the caller's environment (``ip netns exec`` passes it on), so
``sys.executable`` and the venv's binaries work inside a host as outside.

Cleanup: ``Lab.close()`` (also on leaving the ``with`` block, on any exception, and at interpreter
exit for a lab never closed) SIGKILLs every process in each host namespace and deletes all of the
run's namespaces; deleting a veth end deletes its peer. A run that could not clean up (SIGKILLed)
leaves namespaces that are unreachable from the machine; the next ``Lab()`` sweeps those whose
creator pid no longer runs (their processes are killed, their namespaces deleted).
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

PREFIX = "netlab-"
_RUN_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-([0-9a-f]+)-")
_HOST_NAME = re.compile(r"^[a-z][a-z0-9]{0,15}$")
HOST_IFACE = "eth0"
UCX_NETWORK_ONLY = {"UCX_TLS": "tcp"}  # UCX between lab hosts over the lab network only
REPO_ROOT = Path(__file__).resolve().parents[2]

_available: str | None | bool = False  # False: not probed yet


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def list_namespaces() -> list[str]:
    """Names of all named network namespaces of the machine."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split()]


def _kill_namespace_processes(netns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in ``netns`` until none is left (a dying process may have forked)."""
    deadline = time.monotonic() + timeout_s
    while pids := namespace_pids(netns):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in {netns} survive SIGKILL")
        time.sleep(0.02)


def _delete_namespace(netns: str) -> None:
    _kill_namespace_processes(netns)
    _ip("netns", "del", netns, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces of labs whose creating process is gone; their names."""
    stale = [ns for ns in list_namespaces()
             if (m := _RUN_NAME.match(ns)) and not _pid_alive(int(m.group(1)))]
    for ns in sorted(stale, key=lambda n: n.endswith("-sw")):  # hosts first, then the switch
        _delete_namespace(ns)
    return stale


def available() -> str | None:
    """None if labs can be built on this machine, else why not (one line, for ``pytest.skip``).
    Probes once: a namespace pair with a bridge and a veth, deleted again."""
    global _available
    if _available is not False:
        return _available  # type: ignore[return-value]
    _available = _probe()
    return _available


def _probe() -> str | None:
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (euid is not 0)"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-"
    a, b = probe + "sw", probe + "probe"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("-n", a, "link", "add", "br0", "type", "bridge")
        _ip("-n", a, "link", "add", "p1", "type", "veth", "peer", "name", HOST_IFACE, "netns", b)
        _ip("-n", a, "link", "set", "p1", "master", "br0")
        subprocess.run(["ip", "netns", "exec", b, "true"], check=True, capture_output=True, timeout=10)
    except (RuntimeError, subprocess.SubprocessError, OSError) as e:
        return f"cannot build a network namespace lab here: {str(e).splitlines()[0][:200]}"
    finally:
        for ns in (b, a):
            _ip("netns", "del", ns, check=False)
    return None


# a plain-Python forwarder run inside a host (``Host.bridge``): the test process (in the root namespace,
# off the lab network) reaches a port of the host through a Unix socket, which every namespace shares
UNIX_BRIDGE = r"""
import asyncio, sys
path, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    finally:
        w.close()
async def handle(r, w):
    try:
        tr, tw = await asyncio.open_connection(host, port)
    except OSError:
        w.close()
        return
    await asyncio.gather(pipe(r, tw), pipe(tr, w), return_exceptions=True)
async def main():
    server = await asyncio.start_unix_server(handle, path)
    print("bridging", flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over the Unix socket of a ``Host.bridge``."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("gateway", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def unix_request(path: str, method: str, url: str, body: dict | None = None,
                 timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """One JSON request through the bridge at ``path``: (status, headers, body)."""
    conn = UnixHTTPConnection(path, timeout)
    try:
        conn.request(method, url, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


class Host:
    """One network namespace with one interface on the lab's switch."""

    def __init__(self, lab: Lab, name: str, index: int, netns: str, address: str) -> None:
        self.lab, self.name, self.index, self.netns, self.address = lab, name, index, netns, address
        self.iface = HOST_IFACE
        self.switch_port = f"p{index}"
        self.procs: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address}, netns={self.netns})"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host."""
        return ["ip", "netns", "exec", self.netns, *map(str, argv)]

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` in this host (in a session of its own, cwd the repository unless given);
        ``env`` None: this process's environment. Kept for ``kill_all`` and ``Lab.close``."""
        kw.setdefault("start_new_session", True)
        kw.setdefault("cwd", REPO_ROOT)
        proc = subprocess.Popen(self.argv(argv), env=None if env is None else dict(env), **kw)
        self.procs.append(proc)
        return proc

    def popen_ready(self, argv: Sequence[str], ready: str | re.Pattern, timeout_s: float = 20.0,
                    env: Mapping[str, str] | None = None, **kw) -> tuple[subprocess.Popen, re.Match]:
        """Start ``argv`` here and return once a line of its output (stdout and stderr together)
        matches ``ready`` (a regex), with the match. A thread keeps draining the output after that
        (``proc.lines`` holds the last 2000 lines; with ``NETLAB_LOG_DIR`` set, every line is also
        written to a file there). The process is killed if it exits first or is
        not ready within ``timeout_s``."""
        pattern = re.compile(ready) if isinstance(ready, str) else ready
        proc = self.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1, **kw)
        lines: list[str] = []
        proc.lines = lines  # type: ignore[attr-defined]
        found: list[re.Match] = []
        event = threading.Event()

        log_dir = os.environ.get("NETLAB_LOG_DIR")
        log = open(os.path.join(log_dir, f"{self.name}-{os.path.basename(str(argv[0]))}-{proc.pid}.log"), "a") \
            if log_dir else None

        def pump() -> None:
            for line in proc.stdout:
                if log is not None:
                    log.write(line)
                    log.flush()
                lines.append(line.rstrip("\n"))
                del lines[:-2000]
                if not event.is_set() and (m := pattern.search(line)):
                    found.append(m)
                    event.set()
            event.set()
            if log is not None:
                log.close()

        threading.Thread(target=pump, name=f"netlab-{self.name}-output", daemon=True).start()
        if not event.wait(timeout_s) or not found:
            proc.kill()
            proc.wait()
            tail = "\n".join(lines[-20:])
            raise RuntimeError(f"{argv[0]} in host {self.name} did not print /{pattern.pattern}/ "
                               f"within {timeout_s}s (exit {proc.returncode}):\n{tail}")
        return proc, found[0]

    def run(self, argv: Sequence[str], timeout: float = 60.0, env: Mapping[str, str] | None = None,
            **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` here to completion (output captured as text unless told otherwise)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("cwd", REPO_ROOT)
        return subprocess.run(self.argv(argv), timeout=timeout, env=None if env is None else dict(env), **kw)

    def bridge(self, path: str | os.PathLike, port: int) -> str:
        """Forward the Unix socket ``path`` to this host's ``port`` on its lab address (``UNIX_BRIDGE``),
        for ``UnixHTTPConnection``/``unix_request``; returns the path once it listens."""
        self.popen_ready([sys.executable, "-c", UNIX_BRIDGE, str(path), self.address, str(port)], "bridging")
        return str(path)

    def pids(self) -> list[int]:
        """Every process in this host's namespace, whoever started it."""
        return namespace_pids(self.netns)

    def kill_all(self) -> None:
        """The host vanishes: SIGKILL every process in its namespace, then reap those we started."""
        _kill_namespace_processes(self.netns)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.procs.clear()

    def link_down(self, at: str = "host") -> None:
        """Cut this host off the network. ``at="host"``: its own interface goes down (its routes go,
        so its connects fail at once with ENETUNREACH; peers' packets to it are dropped).
        ``at="switch"``: the switch's end goes down, as a pulled cable: the host keeps its
        address and routes and sees no carrier; packets either way are dropped, so both sides see
        only timeouts. Established connections are not reset either way."""
        self._set_link("down", at)

    def link_up(self, at: str = "host", timeout_s: float = 5.0) -> None:
        """Undo ``link_down(at)``; returns once the host's interface is operationally up."""
        self._set_link("up", at)
        deadline = time.monotonic() + timeout_s
        while self.operstate() != "UP":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.iface} in {self.netns} is {self.operstate()} after link up")
            time.sleep(0.01)

    def _set_link(self, state: str, at: str) -> None:
        if at == "host":
            _ip("-n", self.netns, "link", "set", "dev", self.iface, state)
        elif at == "switch":
            _ip("-n", self.lab.switch, "link", "set", "dev", self.switch_port, state)
        else:
            raise ValueError(f"at must be 'host' or 'switch', not {at!r}")

    def operstate(self) -> str:
        info = json.loads(_ip("-n", self.netns, "-j", "link", "show", "dev", self.iface).stdout)
        return info[0]["operstate"]


class Lab:
    """A switch namespace and any number of hosts on it; a context manager. See the module doc."""

    def __init__(self, subnet_octet: int | None = None) -> None:
        reason = available()
        if reason is not None:
            raise RuntimeError(reason)
        sweep_stale()
        self.run_id = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.octet = subnet_octet if subnet_octet is not None else 1 + secrets.randbelow(254)
        self.subnet = f"10.213.{self.octet}.0/24"
        self.switch = f"{self.run_id}-sw"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "dev", "br0", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def namespaces(self) -> list[str]:
        """This run's namespaces that exist now (empty after ``close``)."""
        return [ns for ns in list_namespaces() if ns.startswith(self.run_id + "-")]

    def _add_namespace(self, netns: str) -> None:
        _ip("netns", "add", netns)
        self._namespaces.append(netns)
        _ip("-n", netns, "link", "set", "dev", "lo", "up")

    def add_host(self, name: str) -> Host:
        """A new namespace ``<run>-<name>`` with ``lo`` up and ``eth0`` on the switch (up)."""
        if self._closed:
            raise RuntimeError("lab is closed")
        if not _HOST_NAME.match(name) or name == "sw":
            raise ValueError(f"host name {name!r}: lowercase letters and digits, first a letter, not 'sw'")
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        index = len(self.hosts) + 1
        if index > 253:
            raise ValueError("a lab has at most 253 hosts")
        host = Host(self, name, index, f"{self.run_id}-{name}", f"10.213.{self.octet}.{index}")
        self._add_namespace(host.netns)
        self.hosts[name] = host
        port = host.switch_port
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", HOST_IFACE,
            "netns", host.netns)
        _ip("-n", self.switch, "link", "set", "dev", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", "dev", port, "up")
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", HOST_IFACE)
        host.link_up()
        return host

    def close(self) -> None:
        """Kill every process in every host and delete all of this run's namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        errors = []
        for host in self.hosts.values():
            try:
                host.kill_all()
            except Exception as e:  # noqa: BLE001 — go on deleting the rest
                errors.append(e)
        # a namespace named by a run this object never recorded (add failed half-way) is caught by name
        for ns in sorted(set(self._namespaces) | set(self.namespaces()), key=lambda n: n == self.switch):
            try:
                _delete_namespace(ns)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise RuntimeError(f"lab {self.run_id} cleanup: {errors}")
