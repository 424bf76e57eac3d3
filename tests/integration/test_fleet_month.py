"""A month of operating a fleet, in minutes: three hosts of the network-namespace lab
(tests/integration/netlab.py) under a steady trickle of chat requests, through every routine event
an operator causes, none of which may cost a request outside its documented window.

- ``cp``: the control plane alone (``tandem up --decode 0``, an embedded NATS cluster of three
  members on its lab address over TLS, a fixed state directory);
- ``wa``: a decode worker (``tandem join``, ``--max-local-prefill-tokens 0``: every prompt is
  prefilled remotely);
- ``wb``: a prefill worker (``tandem join``): its KV crosses the lab network into wa over NIXL.

Events, one at a time, each followed by every host back in the registry by itself:
1. the control plane restarted twice (SIGTERM, then ``tandem up`` again on the same state directory:
   same NATS password and port, so the joined workers reconnect untouched);
2. the NATS login rotated (``tandem credentials rotate``; the new connect.env copied over the joined
   hosts' copies, which their running joins take over);
3. wb re-imaged (its join stopped, its state directory with its host id deleted, joined again under
   the same host name);
4. Redis restarted empty (the embedded redis-server SIGKILLed and its data directory deleted; tandem
   up's supervisor starts it again);
5. a NATS member replaced (one of the three SIGKILLed; the supervisor starts it again).

The documented windows: the gateway refuses connections while ``tandem up`` is down (1) and while
the rotation restarts it (2); a request refused there is sent again. A 429/503 with Retry-After is
re-admitted anywhere. Anything else is a failed request. wb's remote prefills for wa are counted
before the first event and after the last; at the end every process exits 0 and leaves none behind.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from netlab import UCX_NETWORK_ONLY, Lab, available, unix_request

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.long]

if (why := available()) is not None:
    pytest.skip(f"no network lab here: {why}", allow_module_level=True)

from stack_helpers import wait_for  # noqa: E402

TANDEM = [sys.executable, "-m", "services.cli"]
GATEWAY_PORT = 8000
TTL_S = 3.0
ENGINE = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--compile", "off", "--num-threads", "1"]
STEADY = "steady"  # the label of requests sent outside every window
PROMPT = ("A lighthouse keeper writes in the logbook every evening: the weather, the ships that passed, "
          "the oil burned and the state of the lamp. Tonight, entry number {n}, reads:")


class Gateway:
    """cp's gateway, reached through the Unix-socket bridge running inside cp."""

    def __init__(self, path: str, model: str) -> None:
        self.path, self.model = path, model

    def call(self, method: str, url: str, body: dict | None = None, timeout: float = 60.0):
        return unix_request(self.path, method, url, body, timeout)

    def workers(self) -> dict[str, dict]:
        """worker_id -> {"info", "load"} from /status; {} while the gateway does not answer."""
        try:
            code, _, body = self.call("GET", "/status", timeout=10)
        except (OSError, http.client.HTTPException):
            return {}
        return {w["info"]["worker_id"]: w for w in json.loads(body)["workers"]} if code == 200 else {}

    def chat(self, n: int):
        return self.call("POST", "/v1/chat/completions", {
            "model": self.model, "messages": [{"role": "user", "content": PROMPT.format(n=n)}],
            "max_tokens": 6, "temperature": 0})


class Trickle:
    """One chat request about every 0.5 s from a thread. ``event`` (set by the test) labels the
    event under way, and ``window`` whether it is a documented window of refused connections: a
    connection refused or cut inside one is retried, outside one it is a failure; a 429/503 with
    Retry-After is re-admitted anywhere. Counts per event."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.event: str = STEADY
        self.window = False
        self.num_ok = 0
        self.readmitted: collections.Counter[str] = collections.Counter()  # attempts answered 429/503
        self.retried: collections.Counter[str] = collections.Counter()  # requests retried at least once
        self.refused: collections.Counter[str] = collections.Counter()  # attempts refused or cut
        self.reasons: dict[str, str] = {}  # per event, the first 429/503's body
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trickle", daemon=True)

    def __enter__(self) -> Trickle:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), "a request hung"

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(0.5):
            n += 1
            self._one(n)

    def _one(self, n: int) -> None:
        deadline, retried_in = time.monotonic() + 180, set()
        while time.monotonic() < deadline and not self._stop.is_set():
            event, window = self.event, self.window
            try:
                code, headers, body = self.gateway.chat(n)
            except (OSError, http.client.HTTPException) as exc:
                if not (window or self.window):  # or a window opened while it was in flight
                    self.failed.append(f"request {n} during {event}: {type(exc).__name__}: {exc}")
                    return
                self.refused[self.event] += 1
                if self.event not in retried_in:
                    retried_in.add(self.event)
                    self.retried[self.event] += 1
                time.sleep(0.5)
                continue
            if code == 200 and json.loads(body)["choices"][0]["message"]["content"] is not None:
                self.num_ok += 1
                return
            if code in (429, 503) and "Retry-After" in headers:
                self.readmitted[event] += 1
                self.reasons.setdefault(event, body[:160].decode(errors="replace"))
                time.sleep(min(float(headers["Retry-After"]), 2.0))
                continue
            self.failed.append(f"request {n} during {event}: HTTP {code}: {body[:300]!r}")
            return
        if not self._stop.is_set():
            self.failed.append(f"request {n}: not served within 180 s")

    def wait_served(self, count: int, timeout_s: float = 120.0) -> None:
        """Until ``count`` more requests were served."""
        target = self.num_ok + count
        wait_for(lambda: self.num_ok >= target, timeout_s, f"{count} more requests served")


class Fleet:
    """The lab's hosts and the processes the test started on them."""

    def __init__(self, lab: Lab, tmp: Path, model: Path) -> None:
        self.lab, self.tmp, self.model = lab, tmp, model
        self.namespace = f"f{uuid.uuid4().hex[:8]}"
        self.env = {**os.environ, **UCX_NETWORK_ONLY, "TQDM_DISABLE": "1"}
        self.cp, self.wa, self.wb = lab.add_host("cp"), lab.add_host("wa"), lab.add_host("wb")
        self.up: subprocess.Popen | None = None
        self.joins: dict[str, subprocess.Popen] = {}
        self.worker_ids = {"wa": f"{self.namespace}-wa-decode-1", "wb": f"{self.namespace}-wb-prefill-1"}

    @property
    def connect_file(self) -> Path:
        return self.tmp / "cp" / self.namespace / "connect.env"

    def start_up(self) -> None:
        self.up, _ = self.cp.popen_ready(
            [*TANDEM, "up", "--model", self.model, "--decode", "0", "--nats-host", self.cp.address,
             "--nats-cluster", "3", "--nats-tls",
             "--host", self.cp.address, "--port", GATEWAY_PORT, "--state-dir", self.tmp / "cp",
             "--namespace", self.namespace, "--registry-ttl-s", TTL_S, "--restart-max-backoff-s", "2",
             *ENGINE], r"\| ready: http", timeout_s=300, env=self.env)

    def stop_up(self) -> None:
        self.up.send_signal(signal.SIGTERM)
        assert self.up.wait(90) == 0, self.up.lines[-20:]

    def copy_connect(self, host_name: str) -> Path:
        """The operator's copy of cp's connect.env on a joined host."""
        copy = self.tmp / f"{host_name}-connect" / "connect.env"
        copy.parent.mkdir(exist_ok=True)
        shutil.copyfile(self.connect_file, copy)
        shutil.copyfile(self.connect_file.parent / "tls" / "ca.pem", copy.parent / "ca.pem")
        return copy

    def join(self, host_name: str) -> subprocess.Popen:
        role = ["--decode", "1", "--prefill", "0", "--max-local-prefill-tokens", "0"] if host_name == "wa" \
            else ["--decode", "0", "--prefill", "1"]
        proc, _ = self.lab[host_name].popen_ready(
            [*TANDEM, "join", "--connect", self.copy_connect(host_name), "--model", self.model,
             "--host-name", host_name, "--state-dir", self.tmp / host_name, "--ready-timeout-s", "300",
             "--restart-max-backoff-s", "2", *role, *ENGINE], r"\| ready: ", timeout_s=320, env=self.env)
        self.joins[host_name] = proc
        return proc

    def stop_join(self, host_name: str) -> None:
        proc = self.joins.pop(host_name)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, proc.lines[-20:]

    def server_pids(self, name: str) -> list[int]:
        """The pids of cp's processes running the executable ``name`` (redis-server, nats-server)."""
        return sorted(pid for pid in self.cp.pids() if _executable(pid).endswith(f"/{name}"))


def _executable(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")  # redis-server rewrites its command line
    except OSError:  # gone since it was listed
        return ""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone since it was listed
        return b""


def all_back(gateway: Gateway, fleet: Fleet, pids: dict[str, int] | None = None,
             since: float = 0.0) -> dict[str, int] | None:
    """{host: worker pid} once every joined host's worker is ready in the registry with a heartbeat
    after ``since`` (wall clock; with the pids given: the same processes, nothing restarted); else None."""
    workers = gateway.workers()
    entries = {host: workers.get(worker_id, {}).get("info", {}) for host, worker_id in fleet.worker_ids.items()}
    if not all(e.get("state") == "ready" and e["heartbeat_at"] > since for e in entries.values()):
        return None
    now = {host: e["pid"] for host, e in entries.items()}
    return now if pids is None or now == pids else None


def remote_prefills(gateway: Gateway, fleet: Fleet) -> tuple[int, int] | None:
    """(wb's prefill worker's num_remote_prefills, its pid) from its latest load report."""
    worker = gateway.workers().get(fleet.worker_ids["wb"])
    if not worker or not worker.get("load"):
        return None
    return worker["load"]["num_remote_prefills"], worker["info"]["pid"]


def prefills_grow(gateway: Gateway, fleet: Fleet, trickle: Trickle) -> int:
    """Remote prefills wb did for wa while the trickle runs: its counter rises in its load reports."""
    first = wait_for(lambda: remote_prefills(gateway, fleet), 60, "wb's load report")
    trickle.wait_served(4)
    later = wait_for(lambda: (now := remote_prefills(gateway, fleet)) and now[1] == first[1]
                       and now[0] > first[0] and now, 60, "wb's remote prefills counted")
    return later[0] - first[0]


def test_joined_hosts_ride_through_a_month_of_operations_by_themselves(heads_32, tmp_path):
    """Over a minute (two to three on 2 cores): the control plane starts three times and the workers
    load up to three times (start, rotation, re-image), each event in real time, under load."""
    with Lab() as lab:
        fleet = Fleet(lab, tmp_path, heads_32)
        fleet.start_up()
        for name in ("wa", "wb"):
            fleet.join(name)
        bridge = fleet.cp.bridge(tmp_path / "gateway.sock", GATEWAY_PORT)
        gateway = Gateway(bridge, str(heads_32))
        pids = wait_for(lambda: all_back(gateway, fleet), 60, "both joined workers in the registry")
        measured = {}
        with Trickle(gateway) as trickle:
            measured["remote prefills before"] = prefills_grow(gateway, fleet, trickle)
            for restart in (1, 2):
                trickle.event, trickle.window = f"control plane restart {restart}", True
                fleet.stop_up()
                fleet.start_up()
                # the joined workers are back by themselves, the same processes, beating again
                since = time.time()
                wait_for(lambda: all_back(gateway, fleet, pids, since), 60, f"both hosts back after {trickle.event}")
                trickle.wait_served(2)
                trickle.event, trickle.window = STEADY, False
            rotate_credentials(fleet, gateway, trickle)
            reimage_wb(fleet, gateway, trickle)
            restart_redis_empty(fleet, gateway, trickle)
            replace_nats_member(fleet, gateway, trickle)
            measured["remote prefills after"] = prefills_grow(gateway, fleet, trickle)
        report = (f"{trickle.num_ok} requests served, {len(trickle.failed)} failed; attempts re-admitted "
                  f"(429/503) per event {dict(trickle.readmitted)}; requests retried (connection refused or "
                  f"cut) per event {dict(trickle.retried)}, in attempts {dict(trickle.refused)}; wb's remote "
                  f"prefills for wa {measured}")
        print(report, "\nfirst re-admission per event:", trickle.reasons)
        assert not trickle.failed, (trickle.failed, report)
        assert measured["remote prefills before"] > 0 and measured["remote prefills after"] > 0, report
        stop_everything(fleet, bridge)


def rotate_credentials(fleet: Fleet, gateway: Gateway, trickle: Trickle) -> None:
    """``tandem credentials rotate`` on cp; the new connect.env copied over each joined host's copy
    is taken over by its running join (its workers restarted with the new login)."""
    trickle.event, trickle.window = "credentials rotation", True  # the gateway restarts with the new login
    old = fleet.connect_file.read_text()
    done = fleet.cp.run([*TANDEM, "credentials", "rotate", "--overlap-s", "120", "--state-dir", fleet.tmp / "cp",
                         "--namespace", fleet.namespace], env=fleet.env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert fleet.connect_file.read_text() != old
    wait_for(lambda: any("every service of this host runs with the new NATS login" in line
                           for line in fleet.up.lines), 180, "cp's services restarted with the new login")
    for name, proc in fleet.joins.items():
        num_lines = len(proc.lines)
        fleet.copy_connect(name)
        wait_for(lambda: any("every worker of this host runs with the new NATS login" in line
                               for line in proc.lines[num_lines:]), 180, f"{name}'s workers on the new login")
    since = time.time()
    wait_for(lambda: all_back(gateway, fleet, since=since), 60, "both hosts back after the rotation")
    trickle.wait_served(2)
    trickle.event, trickle.window = STEADY, False
    done = fleet.cp.run([*TANDEM, "credentials", "finish", "--state-dir", fleet.tmp / "cp",
                         "--namespace", fleet.namespace], env=fleet.env)
    assert done.returncode == 0, done.stdout + done.stderr
    for name, proc in fleet.joins.items():  # every host already on the new login: none refused
        assert proc.poll() is None, proc.lines[-20:]


def reimage_wb(fleet: Fleet, gateway: Gateway, trickle: Trickle) -> None:
    """wb's join stopped, its state directory (its host id) deleted, joined again as ``wb``: a new
    host id under the same name takes over; wa is not touched."""
    trickle.event = "re-image of wb"  # no window: wa prefills alone meanwhile
    host_id = (fleet.tmp / "wb" / f"join-{fleet.namespace}" / "host-id").read_text()
    wa_pid = all_back(gateway, fleet)["wa"]
    fleet.stop_join("wb")
    shutil.rmtree(fleet.tmp / "wb")
    fleet.join("wb")
    since = time.time()
    assert (fleet.tmp / "wb" / f"join-{fleet.namespace}" / "host-id").read_text() != host_id
    pids = wait_for(lambda: all_back(gateway, fleet, since=since), 60, "both hosts back after wb's re-image")
    assert gateway.workers()[fleet.worker_ids["wb"]]["info"]["host_id"] != host_id.strip()
    assert pids["wa"] == wa_pid
    trickle.wait_served(2)
    trickle.event = STEADY


def restart_redis_empty(fleet: Fleet, gateway: Gateway, trickle: Trickle) -> None:
    """The embedded redis-server SIGKILLed and its data directory deleted: tandem up's supervisor
    starts it again, empty; the kv-index rebuilds from the KV event stream; nothing else restarts."""
    trickle.event = "redis restarted empty"  # no window: the gateway routes on load alone meanwhile
    pids = all_back(gateway, fleet)
    (killed,) = fleet.server_pids("redis-server")
    shutil.rmtree(fleet.tmp / "cp" / fleet.namespace / "redis")  # nothing in it is needed while it runs
    os.kill(killed, signal.SIGKILL)
    wait_for(lambda: any("redis-server restarted" in line for line in fleet.up.lines), 60, "redis-server restarted")
    assert fleet.server_pids("redis-server") not in ([], [killed])
    trickle.wait_served(4)
    since = time.time()
    wait_for(lambda: all_back(gateway, fleet, pids, since), 30, "both hosts beating after Redis's restart")
    trickle.event = STEADY


def replace_nats_member(fleet: Fleet, gateway: Gateway, trickle: Trickle) -> None:
    """One of the three nats-servers SIGKILLed: tandem up's supervisor starts it again on its port
    and store; clients on it fail over to the other two; nothing else restarts."""
    trickle.event = "NATS member replaced"  # no window: the other two members serve meanwhile
    pids = all_back(gateway, fleet)
    members = fleet.server_pids("nats-server")
    assert len(members) == 3, members
    num_lines = len(fleet.up.lines)
    os.kill(members[1], signal.SIGKILL)
    wait_for(lambda: any("nats-" in line and " restarted (restart 1" in line for line in fleet.up.lines[num_lines:]),
               60, "the NATS member restarted")
    assert len(fleet.server_pids("nats-server")) == 3
    trickle.wait_served(4)
    since = time.time()
    wait_for(lambda: all_back(gateway, fleet, pids, since), 30, "both hosts beating after the member's restart")
    trickle.event = STEADY


def stop_everything(fleet: Fleet, bridge: str) -> None:
    """SIGTERM the joins and tandem up: each exits 0 and leaves no process on its host."""
    for name in list(fleet.joins):
        fleet.stop_join(name)
    fleet.stop_up()
    for proc in fleet.cp.procs:  # the bridge
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
    for host in (fleet.cp, fleet.wa, fleet.wb):
        wait_for(lambda: not host.pids(), 30, f"no process left on {host.name}: "
                   f"{[_cmdline(p) for p in host.pids()]}")
