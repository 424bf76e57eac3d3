"""The documented custom worker (plain nats-py + JSON, no Tandem imports) joins the cluster:
admission routes to it and the gateway streams its tokens as text. Slow: the gateway loads the
real tokenizer."""

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

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "echo_worker.py"


@pytest.fixture
def echo_worker(nats_url, namespace):
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--nats-url", nats_url, "--namespace",
                             namespace, "--worker-id", "echo-1", "--ttl", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert "serving" in proc.stdout.readline()
    yield proc
    proc.kill()
    proc.wait()


async def test_echo_worker_serves_through_admission_and_gateway(echo_worker, bus, nats_url, namespace):
    common = dict(nats_url=nats_url, namespace=namespace, registry_ttl_s=5.0)
    registry = await WorkerRegistry.open(bus, Subjects(namespace).workers_bucket, ttl_s=5.0, watch=True)
    await AdmissionService(AdmissionSettings(**common), bus, registry).start()
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    gateway = Gateway(GatewaySettings(**common), bus, registry, tokenizer)

    async def registered():
        gateway.workers = await registry.list()
        return gateway.ready_workers()

    await wait_until(registered, timeout_s=10, what="the echo worker in the registry")
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
