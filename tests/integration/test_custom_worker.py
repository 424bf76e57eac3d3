"""The documented custom workers join the cluster: the Python one (plain nats-py + JSON, no Tandem
imports) and the Node.js one (npm's nats). Admission routes to each, the gateway streams its tokens
as text, and ``tandem worker-check`` passes it. Slow: the gateway loads the real tokenizer."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.admission.config import AdmissionSettings
from services.admission.service import AdmissionService
from services.gateway.config import GatewaySettings
from services.gateway.service import Gateway, build_app, load_tokenizer
from shared.bus import WorkerRegistry
from shared.model.registry import DEFAULT_MODEL
from shared.protocol import Subjects
from shared.runtime.waiting import wait_until
from stack_helpers import tool_missing

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
EXAMPLE = EXAMPLES / "echo_worker.py"
NODE_WORKER = EXAMPLES / "node_worker" / "worker.mjs"


@pytest.fixture
def echo_worker(nats_url, namespace):
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--nats-url", nats_url, "--namespace",
                             namespace, "--worker-id", "echo-1", "--ttl", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert "serving" in proc.stdout.readline()
    yield proc
    proc.kill()
    proc.wait()


async def admission_and_gateway(bus, nats_url: str, namespace: str, what: str):
    """Admission serving and a gateway (not yet serving HTTP) that lists the worker; returns
    (gateway, its tokenizer, the registry)."""
    common = dict(nats_url=nats_url, namespace=namespace, registry_ttl_s=5.0)
    registry = await WorkerRegistry.open(bus, Subjects(namespace).workers_bucket, ttl_s=5.0, watch=True)
    await AdmissionService(AdmissionSettings(**common), bus, registry).start()
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    gateway = Gateway(GatewaySettings(**common), bus, registry, tokenizer)

    async def registered():
        gateway.workers = await registry.list()
        return gateway.ready_workers()

    await wait_until(registered, timeout_s=10, what=what)
    return gateway, tokenizer, registry


async def test_echo_worker_serves_through_admission_and_gateway(echo_worker, bus, nats_url, namespace):
    gateway, tokenizer, _ = await admission_and_gateway(bus, nats_url, namespace, "the echo worker in the registry")
    ids = tokenizer.encode("Hello tandem")
    expected = tokenizer.decode((ids * 3)[:5])
    async with TestClient(TestServer(build_app(gateway))) as client:
        resp = await client.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "Hello tandem",
                                                          "max_tokens": 5})
        body = await resp.json()
        assert resp.status == 200, body
        assert resp.headers["X-Tandem-Worker"] == "echo-1"
        assert body["choices"][0]["text"] == expected
        assert body["usage"]["completion_tokens"] == 5
        resp = await client.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "Hello tandem",
                                                          "max_tokens": 5, "stream": True})
        assert expected.split()[0] in await resp.text()


@pytest.fixture
def node_worker(nats_url, namespace):
    if shutil.which("node") is None:
        tool_missing("node is not installed (the python machine image has it; install.sh installs its package)")
    assert (NODE_WORKER.parent / "node_modules" / "nats").is_dir(), "run ./install.sh (npm ci of the node worker)"
    proc = subprocess.Popen(["node", str(NODE_WORKER), "--nats-url", nats_url, "--namespace", namespace,
                             "--worker-id", "node-1", "--ttl", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    assert "serving" in line, line + proc.stdout.read() if proc.poll() is not None else line
    yield proc
    proc.kill()
    proc.wait()


async def test_node_worker_serves_through_the_gateway_passes_worker_check_and_drains(node_worker, bus, nats_url,
                                                                                     namespace):
    from shared.cli.worker_check import check_worker

    gateway, tokenizer, registry = await admission_and_gateway(bus, nats_url, namespace,
                                                               "the node worker in the registry")
    ids = tokenizer.encode("Hello tandem")
    expected = tokenizer.decode((ids * 3)[:5])
    async with TestClient(TestServer(build_app(gateway))) as client:
        resp = await client.post("/v1/chat/completions", json={
            "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5})
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Tandem-Worker"] == "node-1"
        resp = await client.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "Hello tandem",
                                                          "max_tokens": 5, "stream": True})
        assert resp.status == 200 and expected.split()[0] in await resp.text()

    checks = await check_worker(nats_url, namespace, "node-1", prompt=[1, 2, 3], timeout_s=20)
    assert [c.line() for c in checks if c.outcome != "PASS"] == []
    assert any("note" not in c.reason for c in checks if c.name == "registry entry")  # the engine's namespace

    node_worker.terminate()
    assert node_worker.wait(30) == 0
    assert "drained and deregistered" in node_worker.stdout.read()
    await wait_until(lambda: _gone(registry, "node-1"), timeout_s=3, what="the node worker's entry deleted")


async def _gone(registry: WorkerRegistry, worker_id: str) -> bool:
    return worker_id not in {w.worker_id for w in await registry.list()}
