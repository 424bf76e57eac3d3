"""The whole stack on one machine: embedded nats-server and redis-server (unless URLs are given)
and every service as its own process. Used by ``tandem up`` and the integration tests.

With ``restart_children`` a supervisor thread starts again any child that crashes (see
``services.stack.supervisor``), passing it ``--num-restarts`` so that workers report the count in
the registry and thus in ``tandem status``. It restarts the embedded nats-server and redis-server
too, whatever their exit code (nothing works without them), on the same port, data directory and
password: services reconnect on their own. ``stop()`` ends the supervisor before it stops anyone.

The embedded NATS keeps its password and client ports from run to run (``KeptLogin``, in its
data directory), so that hosts joined with the last run's ``connect.env`` log in again after a
restart, and changes them only when asked (``services.stack.rotate``: ``set_nats_login`` and
``restart_child``); Redis gets a fresh password each run. Every child gets the server URLs (which
carry them) through its environment, not its command line. Given URLs are used as they are.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shared.openai_api.auth import operator_headers
from services.stack.children import Child, child_env, service_argv, split_secret_flags
from services.stack.nats_login import KeptLogin
from services.stack.servers import (ServerProcess, advertised_host, cluster_url, free_port, start_nats_cluster,
                                    start_nats_server, start_redis_server)
from services.stack.supervisor import Backoff, RestartPolicy
from shared.telemetry.redact import new_secret

_SUPERVISE_INTERVAL_S = 0.2
# Every child serves its metrics on a free port of its own (each publishes the address in the
# service directory), even when TANDEM_METRICS_PORT in our environment names one port for all.
_OWN_METRICS_PORT = {"metrics_port": 0}


@dataclass
class StackSpec:
    state_dir: Path
    num_decode: int = 1
    num_prefill: int = 0
    num_gateways: int = 1             # gateway i listens on port + i ("gateway", "gateway-2", ...)
    num_admissions: int = 1           # one queue group ("admission", "admission-2", ...)
    model: str = "smollm2-135m"
    host: str = "127.0.0.1"
    port: int = 8000                  # 0: a free port
    namespace: str = "tandem"
    nats_url: str | None = None       # None: start an embedded nats-server (or cluster); several: commas
    redis_url: str | None = None      # None: start an embedded redis-server
    nats_cluster: int = 1             # embedded: this many nats-servers routed into one JetStream cluster
    nats_host: str = "127.0.0.1"      # embedded: where NATS listens for clients (0.0.0.0: every interface)
    nats_port: int = 0                # embedded: its client port (0: a free one; a cluster's members port + i)
    advertise_host: str | None = None  # the address other hosts dial for NATS (default: nats_host)
    nats_tls: bool = False            # embedded: clients connect over TLS, verifying a CA made here
    nats_ca: str | None = None        # given nats_url: the CA file its TLS certificate is signed by
    nats_replicas: int | None = None  # copies of each stream and bucket (None: the services detect it)
    # False: workers only, joined to a control plane elsewhere (``tandem join``): no servers, no
    # gateway, admission, kv-index or autoscaler
    control_plane: bool = True
    host_name: str = ""               # in worker ids, so that workers of several hosts never collide
    host_id: str | None = None        # a joined host's id, in its workers' registry entries (services.join.identity)
    registry_ttl_s: float = 6.0
    log_level: str = "INFO"
    # where every child's /metrics listens (None: the services' default, loopback); 0.0.0.0 (or this
    # host's address) lets the control plane's Prometheus scrape another host's workers
    metrics_host: str | None = None
    metrics_key_file: str | None = None  # the key every child's /metrics then requires
    decode_flags: dict[str, object] = field(default_factory=dict)
    prefill_flags: dict[str, object] = field(default_factory=dict)
    # a worker's own flags over its role's, by name ("decode-1"): a plan's parallel shapes and devices
    worker_flags: dict[str, dict[str, object]] = field(default_factory=dict)
    # ranks of parallel workers whose rank 0 runs on another host (``tandem rank``), by name ("rank-1"):
    # restarted whenever they exit, as their group ends whenever its rank 0 restarts
    rank_flags: dict[str, dict[str, object]] = field(default_factory=dict)
    gateway_flags: dict[str, object] = field(default_factory=dict)
    admission_flags: dict[str, object] = field(default_factory=dict)
    # off by default: tests that take a worker away on purpose want it to stay gone
    restart_children: bool = False
    restart_backoff: Backoff = Backoff()
    # a child exiting with one of these is not restarted: its cause outlives a restart (NATS
    # refusing the login: the control plane's password changed); the stack's owner sees it in exited()
    final_exit_codes: frozenset[int] = frozenset()
    autoscaler_flags: dict[str, object] = field(default_factory=dict)
    # set: serve the autoscaler's start/stop requests (services.stack.fleet); a stopped worker
    # drains this long before what it still holds is cut off
    fleet_drain_timeout_s: float | None = None


def print_line(name: str, line: str) -> None:
    sys.stdout.write(f"{name:<12}| {line}\n")
    sys.stdout.flush()


def _local_names(listen_host: str) -> list[str]:
    """Names and addresses a client on this machine may dial: loopback, the host name, and the
    listen address itself when it is a specific one."""
    import socket  # noqa: PLC0415

    names = ["127.0.0.1", "localhost", socket.gethostname()]
    return names if listen_host in ("0.0.0.0", "", "::") else [listen_host, *names]


def _nth(service: str, i: int) -> str:
    """The name of a service's ``i``-th instance: the first keeps the plain name."""
    return service if i == 0 else f"{service}-{i + 1}"


class Stack:
    def __init__(self, spec: StackSpec, on_line: Callable[[str, str], None] = print_line) -> None:
        self.spec = spec
        self._on_line = on_line
        self._lock = threading.Lock()
        self.servers: list[ServerProcess] = []
        self.children: dict[str, Child] = {}
        self._spawned: dict[str, tuple[str, dict[str, object]]] = {}  # name → (service, flags)
        self._children_lock = threading.Lock()  # spawning vs. supervising vs. stopping
        self._restarts = RestartPolicy(spec.restart_backoff)
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.nats_url = spec.nats_url or ""
        self.nats_login: KeptLogin | None = None  # the embedded NATS's (None: given URLs)
        self.redis_url = spec.redis_url or ""
        self.nats_ca = spec.nats_ca
        self.nats_replicas = spec.nats_replicas
        self.ports = [spec.port + i if spec.port else free_port() for i in range(spec.num_gateways)]
        self.port = self.ports[0]
        self.retired: set[str] = set()  # workers stopped on purpose (scale-down): their exit is expected
        self._fleet = None

    @property
    def base_url(self) -> str:
        return self.base_urls[0]

    @property
    def base_urls(self) -> list[str]:
        """Every gateway's URL, the first one's first."""
        return [f"http://{self.spec.host}:{port}" for port in self.ports]

    def _line(self, name: str, line: str) -> None:
        with self._lock:
            self._on_line(name, line)

    def start(self) -> None:
        spec = self.spec
        spec.state_dir.mkdir(parents=True, exist_ok=True)
        common = self._start_control_plane() if spec.control_plane else {}
        for i in range(spec.num_decode):
            self.spawn_decode(f"decode-{i + 1}", spec.worker_flags.get(f"decode-{i + 1}"))
        for i in range(spec.num_prefill):
            self.spawn_prefill(f"prefill-{i + 1}", spec.worker_flags.get(f"prefill-{i + 1}"))
        for name, flags in spec.rank_flags.items():
            self.spawn(name, "rank", flags)
        if spec.control_plane:
            urls = ",".join(self.base_urls) if spec.num_gateways > 1 else None
            for i, port in enumerate(self.ports):
                self.spawn(_nth("gateway", i), "gateway", {**common, "model": spec.model, "host": spec.host,
                                                           "port": port, "gateway_urls": urls,
                                                           "redis_url": self.redis_url, **spec.gateway_flags})
        if spec.restart_children:
            self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
            self._supervisor.start()
        if spec.fleet_drain_timeout_s is not None:
            from services.stack.fleet import FleetManager

            self._fleet = FleetManager(self, drain_timeout_s=spec.fleet_drain_timeout_s)
            self._fleet.start()

    def _start_control_plane(self) -> dict[str, object]:
        """NATS and Redis unless given, kv-index, admission and the autoscaler; returns the flags
        every service of the control plane shares (the gateways start after the workers)."""
        spec = self.spec
        if not spec.nats_url:
            self._start_nats()
        if not spec.redis_url:
            (spec.state_dir / "redis").mkdir(exist_ok=True)
            server = start_redis_server(spec.state_dir / "redis", password=new_secret(),
                                        on_line=lambda l: self._line("redis", l))
            self._add_server(server)
            self.redis_url = server.url
        common = {**self._bus_flags(), "registry_ttl_s": spec.registry_ttl_s, "log_level": spec.log_level,
                  **self._metrics_flags()}
        self.spawn("kv-index", "kv-index", {**common, "redis_url": self.redis_url})
        for i in range(spec.num_admissions):
            self.spawn(_nth("admission", i), "admission", {**common, **spec.admission_flags})
        self.spawn("autoscaler", "autoscaler", {**common, **spec.autoscaler_flags})
        return common

    def _start_nats(self) -> None:
        """The embedded nats-server, or ``nats_cluster`` of them routed into one cluster; with
        ``nats_tls`` a CA in the state directory signs a certificate for every address clients dial."""
        spec = self.spec
        advertise = spec.advertise_host or advertised_host(spec.nats_host)
        tls = None
        if spec.nats_tls:
            from services.stack.tls import server_tls  # noqa: PLC0415 — cryptography only when asked

            tls = server_tls(spec.state_dir / "tls", [advertise, *_local_names(spec.nats_host)])
            self.nats_ca = str(tls.ca_file)
        kept = KeptLogin.load(spec.state_dir / "nats", spec.nats_cluster) or KeptLogin.new(new_secret(), [])
        ports = None if spec.nats_port or not kept.ports else kept.free_ports(spec.nats_host)
        if kept.ports and ports is None and not spec.nats_port:
            self.log_line(f"NATS ports {list(kept.ports)} of the last run are taken: new ones, so hosts joined before "
                          "need this run's connect.env")
        login = {"user": kept.current.user, "password": kept.current.password, "also_accepted": kept.logins[1:]}
        if spec.nats_cluster > 1:
            servers = start_nats_cluster(spec.state_dir / "nats", spec.nats_cluster, **login,
                                         host=spec.nats_host, advertise=advertise, tls=tls,
                                         on_line=self._line, base_port=spec.nats_port, client_ports=ports)
            self.nats_replicas = self.nats_replicas or min(3, spec.nats_cluster)
        else:
            port = spec.nats_port or (ports[0] if ports else -1)
            servers = [start_nats_server(spec.state_dir / "nats", port=port, **login,
                                         host=spec.nats_host, advertise=advertise, tls=tls,
                                         on_line=lambda l: self._line("nats", l))]
        for server in servers:
            self._add_server(server)
        self.nats_login = kept.with_ports([server.port for server in servers])
        self.nats_login.save(spec.state_dir / "nats")
        self.nats_url = cluster_url(servers)

    def set_nats_login(self, kept: KeptLogin) -> None:
        """The embedded NATS accepts ``kept``'s logins from now on (every member reloaded, the file
        saved); its current one goes into the URL this stack hands out and into every child started
        from now on. Running children keep the URL they were given until ``restart_child``."""
        for server in self.servers:
            if server.config_for is not None:
                server.set_logins(kept.logins)
        self.nats_login = kept
        kept.save(self.spec.state_dir / "nats")
        self.use_nats(cluster_url([s for s in self.servers if s.config_for is not None]), self.nats_ca)

    def use_nats(self, url: str, ca: str | None) -> None:
        """Children started from now on (``restart_child`` included) reach NATS at ``url`` (with its
        login) and verify it with ``ca``; running ones keep what they were given."""
        self.nats_url, self.nats_ca = url, ca
        with self._children_lock:
            for name, (service, flags) in self._spawned.items():
                if "nats_url" in flags:
                    self._spawned[name] = (service, {**flags, "nats_url": url, "nats_ca": ca})

    def rolling_order(self) -> list[str]:
        """Running children in the order a rolling restart takes them: the services behind the
        gateways, then the workers, the gateways last (each waits until the others are back)."""
        names = [n for n, c in self.children.items() if c.is_running() and n not in self.retired]
        rank = {"gateway": 2, "decode": 1, "prefill": 1}
        return sorted(names, key=lambda n: rank.get(self._spawned[n][0], 0))

    def restart_child(self, name: str, drain_timeout_s: float = 15.0) -> Child | None:
        """Stop ``name`` (SIGTERM: a worker drains) and start it again with its flags as they are
        now (e.g. a rotated NATS login); one retired or not running is left as it is. None, with
        nothing done, once the stack is stopping. Call it
        from a thread that outlives the child (the main one): a child dies with the thread that
        started it (PR_SET_PDEATHSIG)."""
        with self._children_lock:
            if self._stopping.is_set():
                return None
            child = self.children[name]
            if name in self.retired or not child.is_running():  # stopped meanwhile: its next start takes them
                return child
            self.retired.add(name)  # its exit is expected: exited() does not report it meanwhile
            child.terminate()
            if not child.wait(drain_timeout_s):
                child.kill()
                child.wait(5)
            service, flags = self._spawned[name]
            child = self._start_child(name, service, flags)
            self.retired.discard(name)
        self._line(self.label, f"{name} restarted with the stack's current settings (pid {child.pid})")
        return child

    def _bus_flags(self) -> dict[str, object]:
        """How every child reaches NATS: the URL(s), the CA, the replicas, the namespace."""
        return {"nats_url": self.nats_url, "namespace": self.spec.namespace, "nats_ca": self.nats_ca,
                "nats_replicas": self.nats_replicas}

    def _metrics_flags(self) -> dict[str, object]:
        """Where every child serves /metrics: a port of its own, on the spec's ``metrics_host``."""
        host, key_file = self.spec.metrics_host, self.spec.metrics_key_file
        return {**_OWN_METRICS_PORT, **({"metrics_host": host} if host else {}),
                **({"metrics_key_file": str(Path(key_file).resolve())} if key_file else {})}

    def _add_server(self, server: ServerProcess) -> None:
        self.servers.append(server)
        self._restarts.started(server.name, time.monotonic())

    def spawn_decode(self, name: str, flags: dict[str, object] | None = None) -> Child:
        """A decode worker with the spec's decode flags, ``flags`` over them (e.g. its own parallel shape)."""
        return self._spawn_worker(name, "decode", {**self.spec.decode_flags, **(flags or {})})

    def spawn_prefill(self, name: str, flags: dict[str, object] | None = None) -> Child:
        return self._spawn_worker(name, "prefill", {**self.spec.prefill_flags, **(flags or {})})

    def _spawn_worker(self, name: str, service: str, flags: dict[str, object]) -> Child:
        with self._children_lock:
            return self._start_worker(name, service, flags)

    def _start_worker(self, name: str, service: str, flags: dict[str, object]) -> Child:
        spec = self.spec
        worker_id = self.worker_id(name)
        # workers sharing one machine split its cores rather than each spinning a thread per core; a
        # tensor-parallel worker's ranks are processes of their own, each with num_threads
        num_ranks = sum(_ranks({**role_flags, **spec.worker_flags.get(f"{role}-{i + 1}", {})})
                        for role, count, role_flags in (("decode", spec.num_decode, spec.decode_flags),
                                                        ("prefill", spec.num_prefill, spec.prefill_flags))
                        for i in range(count))
        threads = {"num_threads": max(1, (os.cpu_count() or 1) // num_ranks)} if num_ranks > 1 else {}
        if flags.get("kv_disk_dir"):  # one disk tier per worker, under its stable name
            flags = {**flags, "kv_disk_dir": str(Path(str(flags["kv_disk_dir"])) / name)}
        return self._start_child(name, service, {
            **self._bus_flags(), "registry_ttl_s": spec.registry_ttl_s,
            "log_level": spec.log_level, "worker_id": worker_id, "host_id": spec.host_id, "model": spec.model,
            **self._metrics_flags(), **threads, **flags})

    # -- the fleet, as the autoscaler changes it (services.stack.fleet) -----------------------------
    def add_worker(self, role: str) -> tuple[str, str, Child]:
        """A new worker of ``role`` under a name not used before: (name, worker id, child)."""
        with self._children_lock:
            if self._stopping.is_set():
                raise RuntimeError("the stack is stopping: no new worker")
            number = 1 + sum(name.startswith(f"{role}-") for name in self._spawned)
            name = f"{role}-{number}"
            flags = self.spec.decode_flags if role == "decode" else self.spec.prefill_flags
            child = self._start_worker(name, role, flags)
        return name, self.worker_id(name), child

    def worker_id(self, name: str) -> str:
        host = f"{self.spec.host_name}-" if self.spec.host_name else ""
        return f"{self.spec.namespace}-{host}{name}"[:64]

    def worker_name(self, worker_id: str) -> str | None:
        return next((n for n in self.children if self.worker_id(n) == worker_id), None)

    def retire(self, name: str, is_retired: bool = True) -> None:
        (self.retired.add if is_retired else self.retired.discard)(name)

    @property
    def label(self) -> str:
        """The name the stack's own lines go under: the command that runs it."""
        return "up" if self.spec.control_plane else "join"

    def log_line(self, line: str) -> None:
        self._line(self.label, line)

    def spawn(self, name: str, service: str, flags: dict[str, object]) -> Child:
        with self._children_lock:
            return self._start_child(name, service, flags)

    def _start_child(self, name: str, service: str, flags: dict[str, object]) -> Child:
        num_restarts = self._restarts.started(name, time.monotonic())
        restarted = {"num_restarts": num_restarts} if num_restarts else {}
        argv_flags, secret_env = split_secret_flags({**flags, **restarted})
        child = Child(name, service_argv(service, argv_flags), child_env(secret_env), self._line)
        self.children[name] = child
        self._spawned[name] = (service, flags)
        return child

    def num_restarts(self, name: str) -> int:
        return self._restarts.num_restarts(name)

    def _supervise(self) -> None:
        while not self._stopping.wait(_SUPERVISE_INTERVAL_S):
            with self._children_lock:
                if self._stopping.is_set():  # stop() won the lock: restart nothing it is stopping
                    return
                self._supervise_once(time.monotonic())

    def _supervise_once(self, now_s: float) -> None:
        for server in self.servers:
            if not server.is_running() and not self._restarts.has_exited(server.name):
                decision = self._restarts.exited(server.name, server.proc.returncode, now_s, is_crash=True)
                self._line(self.label, decision.describe())
        for name, child in list(self.children.items()):
            if not child.is_running() and not self._restarts.has_exited(name):
                returncode = child.proc.returncode
                decision = self._restarts.exited(name, returncode, now_s, is_crash=name in self.spec.rank_flags,
                                                 is_final=returncode in self.spec.final_exit_codes)
                self._line(self.label, decision.describe())
        for name in self._restarts.due(now_s):
            if server := next((s for s in self.servers if s.name == name), None):
                self._restart_server(server, now_s)
                continue
            service, flags = self._spawned[name]
            child = self._start_child(name, service, flags)
            self._line(self.label, f"{name} restarted (restart {self.num_restarts(name)}, pid {child.pid})")

    def _restart_server(self, server: ServerProcess, now_s: float) -> None:
        try:
            server.restart()
        except RuntimeError as exc:  # e.g. its port taken meanwhile: retried after the next backoff
            self._restarts.started(server.name, now_s)
            self._line(self.label, self._restarts.exited(server.name, 1, now_s, is_crash=True).describe()
                       + f": {str(exc).splitlines()[0]}")
            return
        self._restarts.started(server.name, now_s)
        self._line(self.label, f"{server.name} restarted (restart {self.num_restarts(server.name)}, "
                         f"pid {server.pid}, same port and data)")

    def exited(self) -> list[str]:
        """Children that exited, but for workers stopped on purpose."""
        return [n for n, c in self.children.items() if not c.is_running() and n not in self.retired]

    def ready_status(self, base_url: str | None = None) -> dict | None:
        """The gateway's /ready body (a 503 with no decode worker has one too); None while it does
        not answer."""
        try:
            with urllib.request.urlopen((base_url or self.base_url) + "/ready", timeout=2) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as exc:
            try:
                return json.load(exc)
            except ValueError:
                return None
        except (urllib.error.URLError, OSError, ValueError):
            return None

    @property
    def _operator_key_file(self) -> str | None:
        """The gateways' operator key file: given to them, or in the environment they inherit."""
        return self.spec.gateway_flags.get("operator_key_file") or os.environ.get("TANDEM_OPERATOR_KEY_FILE")

    def listed_pids(self) -> set[int] | None:
        """The processes in the service directory, as the first gateway's /status lists them; None
        while it does not answer."""
        try:
            headers = operator_headers(self._operator_key_file)
            request = urllib.request.Request(self.base_url + "/status", headers=headers)
            with urllib.request.urlopen(request, timeout=2) as resp:
                return {int(service["pid"]) for service in json.load(resp).get("services", [])}
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def wait_ready(self, timeout_s: float = 180.0, num_decode: int | None = None,
                   num_prefill: int | None = None) -> None:
        """Until every gateway's /ready answers with ``num_decode`` ready decode workers and
        ``num_prefill`` ready prefill workers (default: all the stack started; with none, once the
        gateways answer)."""
        want = self.spec.num_decode if num_decode is None else num_decode
        want_prefill = self.spec.num_prefill if num_prefill is None else num_prefill
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = self.exited()
            if dead and not self.spec.restart_children:  # else the supervisor retries them
                raise RuntimeError(f"service(s) exited during start-up: {', '.join(dead)}")
            statuses = [self.ready_status(url) for url in self.base_urls]  # every gateway
            if all(status and status.get("num_ready_decode_workers", 0) >= want
                   and status.get("num_ready_prefill_workers", 0) >= want_prefill for status in statuses):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{', '.join(self.base_urls)}: /ready not 200 with {want} decode and {want_prefill} prefill "
                           f"workers in {timeout_s}s")

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM everyone (gateway first so no new work arrives), then SIGKILL stragglers. Nothing
        is restarted from here on."""
        if self._fleet is not None:
            self._fleet.stop()
        with self._children_lock:
            self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
        order = sorted(self.children.values(), key=lambda c: not c.name.startswith("gateway"))
        for child in order:
            child.terminate()
        deadline = time.monotonic() + timeout_s
        for child in order:
            if not child.wait(max(0.1, deadline - time.monotonic())):
                self._line(self.label, f"{child.name} did not stop in {timeout_s:g}s: killing it")
                child.kill()
                child.wait(5)
        for server in reversed(self.servers):
            server.stop()
        self.servers.clear()


def _ranks(flags: dict[str, object]) -> int:
    """Processes of one worker with these flags (a parallel worker's ranks)."""
    return int(flags.get("tensor_parallel_size", 1)) * int(flags.get("pipeline_parallel_size", 1))
