"""compose/docker-compose.yml for real: build the images with compose/build.sh (nothing pulled from
a container registry), bring the stack up under a project name of its own with fresh passwords,
stream a chat completion from the real model, kill one decode container while streams are in flight
(the gateway must carry every one of them to the end on the other worker), and take the stack down
again, leaving no container, network or volume of the project behind.

Needs a Docker daemon (started here when the binaries are installed and none runs, as root),
docker-compose (1.29 or the v2 plugin) and, for the base image, debootstrap; skipped without them.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from loadtest.tools import sse

pytestmark = [pytest.mark.compose, pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
BUILD = ROOT / "compose" / "build.sh"
BASE_IMAGE = "tandem-base:bookworm"
DOCKERD_LOG = Path("/tmp/tandem-test-dockerd.log")


def _run(argv: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def _docker_works() -> bool:
    try:
        return _run(["docker", "info"], timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start_dockerd() -> str | None:
    """Start dockerd in the background where it is installed and we are root; None once `docker
    info` answers, else why not."""
    if not shutil.which("dockerd"):
        return "no Docker daemon runs and dockerd is not installed (Debian: apt-get install docker.io)"
    if os.geteuid() != 0:
        return "no Docker daemon runs and starting dockerd needs root"
    with DOCKERD_LOG.open("ab") as log:
        subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)  # outlives the test, like a system daemon
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _docker_works():
            return None
        time.sleep(1)
    return f"dockerd did not answer within 60 s (see {DOCKERD_LOG})"


def _compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and _run(["docker", "compose", "version"], timeout=20).returncode == 0:
        return ["docker", "compose"]
    return None


def _why_not() -> str | None:
    if not shutil.which("docker"):
        return "docker is not installed (Debian: apt-get install docker.io docker-compose debootstrap)"
    if not _docker_works():
        why = _start_dockerd()
        if why:
            return why
    if _compose_cli() is None:
        return "neither docker-compose nor `docker compose` is installed"
    if _run(["docker", "image", "inspect", BASE_IMAGE]).returncode != 0 and not shutil.which("debootstrap"):
        return f"{BASE_IMAGE} is missing and debootstrap (which builds it) is not installed"
    return None


@pytest.fixture(scope="module")
def docker() -> list[str]:
    why = _why_not()
    if why:
        pytest.skip(f"compose stack: {why}")
    return _compose_cli()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def _stream_chat(port: int, content: str, max_tokens: int, result: dict, ignore_eos: bool = False) -> None:
    """A streamed chat completion; fills ``result``: text, finish_reason, done, errors, chunks, and
    worker (the decode worker it started on)."""
    result.update(text="", finish_reason=None, done=False, errors=[], chunks=0, status=None, worker=None)
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": ignore_eos}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        result["status"] = resp.status
        result["worker"] = resp.getheader("X-Tandem-Worker")
        if resp.status != 200:
            result["errors"].append(resp.read().decode(errors="replace")[:500])
            return
        for event in sse.events(resp):
            if event == sse.DONE:
                result["done"] = True
                break
            if "error" in event:
                result["errors"].append(event["error"])
                continue
            choice = event["choices"][0]
            result["text"] += choice["delta"].get("content") or ""
            result["chunks"] += 1
            if choice.get("finish_reason"):
                result["finish_reason"] = choice["finish_reason"]
    except Exception as exc:  # noqa: BLE001 - the test reports it
        result["errors"].append(repr(exc))
    finally:
        conn.close()


def _metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


class Stack:
    def __init__(self, cli: list[str], env_file: Path, project: str, port: int) -> None:
        self.cli, self.env_file, self.project, self.port = cli, env_file, project, port

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        argv = [*self.cli, "-f", str(COMPOSE_FILE), "--env-file", str(self.env_file), "-p", self.project, *args]
        return _run(argv, timeout=timeout)

    def container(self, service: str) -> str:
        out = _run(["docker", "ps", "-q", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.project}",
                    "--filter", f"label=com.docker.compose.service={service}"]).stdout.split()
        assert len(out) == 1, f"{service}: containers {out}"
        return out[0]

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        found = {kind: _run(["docker", *cmd, "--filter", label]).stdout.split()
                 for kind, cmd in {"containers": ["ps", "-aq"], "networks": ["network", "ls", "-q"],
                                   "volumes": ["volume", "ls", "-q"]}.items()}
        return {kind: ids for kind, ids in found.items() if ids}

    def nats_monitor(self, member: str, path: str) -> dict:
        """A NATS member's monitoring endpoint (port 8222 is not published: asked from inside)."""
        code = f"import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('http://localhost:8222{path}').read().decode())"
        out = _run(["docker", "exec", self.container(member), "python3", "-c", code], timeout=30)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "30", timeout=60).stdout[-12000:]

    def wait_ready(self, timeout_s: float) -> dict:
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            try:
                last = _get_json(f"http://127.0.0.1:{self.port}/ready")
                if last.get("ready") and last.get("num_ready_decode_workers") == 2 \
                        and last.get("num_ready_prefill_workers") == 1:
                    return last
            except OSError as exc:
                last = repr(exc)
            time.sleep(2)
        raise AssertionError(f"gateway not ready with 2 decode and 1 prefill worker in {timeout_s}s: {last}\n"
                             f"{self.logs()}")


def test_compose_stack_serves_survives_a_decode_kill_and_comes_down_clean(docker, tmp_path):
    """Over a minute because it builds the images (a cached build takes seconds, a cold one
    minutes), starts the whole compose stack on the real model and waits for a replaced decode
    worker to serve."""
    t0 = time.monotonic()
    build = _run([str(BUILD)], timeout=1200, cwd=ROOT)
    assert build.returncode == 0, f"compose/build.sh failed:\n{build.stdout[-3000:]}\n{build.stderr[-5000:]}"
    built_s = time.monotonic() - t0

    port = _free_port()
    env_file = tmp_path / "compose.env"
    env_file.write_text(f"NATS_PASSWORD={secrets.token_hex(24)}\nREDIS_PASSWORD={secrets.token_hex(24)}\n"
                        f"TANDEM_GATEWAY_PORT={port}\n")
    env_file.chmod(0o600)
    stack = Stack(docker, env_file, f"tandemtest{os.getpid()}{secrets.token_hex(3)}", port)
    try:
        up = stack.compose("up", "-d", timeout=600)
        assert up.returncode == 0, f"up failed:\n{up.stdout[-3000:]}\n{up.stderr[-5000:]}\n{stack.logs()}"
        stack.wait_ready(timeout_s=420)
        ready_s = time.monotonic() - t0 - built_s

        # the real model answers a streamed request (greedy)
        first: dict = {}
        _stream_chat(port, "What is the capital of France?", 30, first)
        assert first["status"] == 200 and first["done"] and not first["errors"], first
        assert first["finish_reason"] in ("stop", "length") and "Paris" in first["text"], first

        # the NATS cluster: every member routes to the other two, and the streams the services
        # made (buckets are streams too) keep three replicas
        for member in ("nats-1", "nats-2", "nats-3"):
            assert stack.nats_monitor(member, "/routez")["num_routes"] >= 2, member
        jsz = stack.nats_monitor("nats-1", "/jsz?accounts=true&streams=true&config=true")
        streams = {s["name"]: s["config"]["num_replicas"] for a in jsz.get("account_details", [])
                   for s in a.get("stream_detail", [])}
        assert streams and set(streams.values()) == {3}, streams

        # kill one decode worker while streams run on it: each stream still ends normally
        before = _metric(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode(),
                         "tandem_gateway_migrations_total")
        prompts = ["Write a short story about a robot who learns to paint.",
                   "Describe the water cycle in a few sentences.",
                   "List some facts about the planet Mars.",
                   "Explain how a bicycle works.",
                   "Write a poem about the sea.",
                   "Tell me about the history of bread."]
        results = [{} for _ in prompts]
        # long enough (no early EOS) to be running still when the last one has started
        threads = [threading.Thread(target=_stream_chat, args=(port, p, 120, r, True), daemon=True)
                   for p, r in zip(prompts, results)]
        for t in threads:
            t.start()
        # wait until every stream has tokens, then kill the decode worker running the most of them
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not all(r.get("chunks", 0) >= 2 for r in results):
            time.sleep(0.2)
        assert all(r.get("chunks", 0) >= 2 for r in results), f"streams did not start: {results}\n{stack.logs()}"
        # the victim: the decode worker with the most streams still running, as the streams say
        # (the workers' load reports lag by up to a second)
        hosts = {w["info"]["worker_id"]: w["info"]["host"]
                 for w in _get_json(f"http://127.0.0.1:{port}/status")["workers"] if w["info"]["role"] == "decode"}
        running_on = Counter(r["worker"] for r in results if not r["done"])
        assert running_on, f"every stream ended before the kill: {results}"
        worker_id, running = running_on.most_common(1)[0]
        host = hosts[worker_id]
        victim = next(s for s in ("decode-1", "decode-2") if stack.container(s).startswith(host))
        kill = _run(["docker", "kill", stack.container(victim)])
        assert kill.returncode == 0, kill.stderr
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), f"streams still running: {results}"
        lost = [r for r in results if r["errors"] or not r["done"] or r["finish_reason"] not in ("stop", "length")]
        assert not lost, f"{len(lost)} of {len(results)} streams lost after killing {victim} " \
                         f"({running} running on it): {lost}\n{stack.logs()}"
        assert all(r["text"].strip() for r in results), results
        after = _metric(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode(),
                        "tandem_gateway_migrations_total")
        assert after - before >= 1, f"no stream was migrated ({before} -> {after}): the kill hit no request"
        print(f"compose stack: built in {built_s:.0f}s, ready {ready_s:.0f}s after; killed {victim} with "
              f"{running} streams on it, {after - before:.0f} migrated, {len(results)} of {len(results)} completed")
    finally:
        down = stack.compose("down", "-v", "--remove-orphans", "-t", "20", timeout=300)
    assert down.returncode == 0, f"down failed:\n{down.stdout[-3000:]}\n{down.stderr[-3000:]}"
    assert stack.leftovers() == {}, f"left behind by down -v: {stack.leftovers()}"
