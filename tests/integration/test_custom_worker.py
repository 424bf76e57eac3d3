"""The documented custom workers join the cluster: the Python one (plain nats-py + JSON, no Tandem
imports) and the Node.js one (npm's nats). Admission routes to each, the gateway streams its tokens
as text, and ``tandem worker-check`` passes it. The Node worker logs in to a nats-server that wants a
password and TLS (nats.js takes neither from the URL: the example turns them into options) and
stops at the EOS ids the gateway sends in each request. Slow: the gateway loads the real tokenizer."""

import json
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
from shared.bus import Bus, WorkerRegistry
from shared.model.registry import DEFAULT_MODEL
from shared.protocol import Subjects
from services.stack.servers import start_nats_server
from services.stack.tls import server_tls
from services.stack.waiting import wait_until
from shared.telemetry.redact import new_secret
from stack_helpers import tool_missing

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
EXAMPLE = EXAMPLES / "echo_worker.py"
NODE_WORKER = EXAMPLES / "node_worker" / "worker.mjs"
NODE_CONNECT_OPTIONS = EXAMPLES / "node_worker" / "connect_options.mjs"


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


def need_node() -> None:
    if shutil.which("node") is None:
        tool_missing("node is not installed (the python machine image has it; install.sh installs its package)")
    assert (NODE_WORKER.parent / "node_modules" / "nats").is_dir(), "run ./install.sh (npm ci of the node worker)"


@pytest.mark.parametrize("url, ca, options", [
    ("nats://tandem:p%40ss%3Aw@127.0.0.1:4222", None,
     {"servers": ["127.0.0.1:4222"], "user": "tandem", "pass": "p@ss:w"}),
    ("nats://s3cr%2Ft@nats.example:4222", None, {"servers": ["nats.example:4222"], "token": "s3cr/t"}),
    ("tls://u:p@10.0.0.1:4222,tls://u:p@10.0.0.2:4223", "/state/tls/ca.pem",
     {"servers": ["10.0.0.1:4222", "10.0.0.2:4223"], "user": "u", "pass": "p",
      "tls": {"caFile": "/state/tls/ca.pem", "checkServerIdentity": "function"}}),  # names the IPs, not localhost
    ("tls://nats.example", None, {"servers": ["nats.example"], "tls": {}}),
    ("nats://[::1]:4222", None, {"servers": ["[::1]:4222"]}),
    ("127.0.0.1:4222", None, {"servers": ["127.0.0.1:4222"]}),
])
def test_the_node_example_turns_the_urls_credentials_into_nats_js_options(url, ca, options):
    need_node()
    script = (f"import {{ connectOptions }} from {json.dumps(NODE_CONNECT_OPTIONS.as_uri())};"
              f"console.log(JSON.stringify(connectOptions(process.argv[1], process.argv[2] || undefined),"
              f" (k, v) => typeof v === 'function' ? 'function' : v))")
    out = subprocess.run(["node", "--input-type=module", "-e", script, url, ca or ""], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == options


@pytest.fixture(scope="module")
def locked_nats(tmp_path_factory):
    """A nats-server that wants a password and TLS: the URL is ``tls://tandem:<password>@...``."""
    store = tmp_path_factory.mktemp("nats-locked")
    tls = server_tls(store / "tls", ["127.0.0.1"])
    server = start_nats_server(store, password=new_secret(), tls=tls)  # URL-safe, as tandem up makes them
    server.ca_file = str(tls.ca_file)
    yield server
    server.stop()


@pytest.fixture
def locked_env(locked_nats, monkeypatch):
    """What ``connect.env`` holds for such a server: its URL (with the login) and its CA file."""
    monkeypatch.setenv("TANDEM_NATS_URL", locked_nats.url)
    monkeypatch.setenv("TANDEM_NATS_CA", locked_nats.ca_file)
    assert locked_nats.url.startswith("tls://tandem:") and "@127.0.0.1:" in locked_nats.url
    return locked_nats.url


@pytest.fixture
async def locked_bus(locked_env):
    bus = await Bus.connect(locked_env, "test")
    yield bus
    await bus.close()


@pytest.fixture
def node_worker(locked_env, namespace):
    need_node()
    # the URL, login and CA come from the environment, as after sourcing connect.env
    proc = subprocess.Popen(["node", str(NODE_WORKER), "--namespace", namespace, "--worker-id", "node-1", "--ttl", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    assert "serving" in line, line + proc.stdout.read() if proc.poll() is not None else line
    yield proc
    proc.kill()
    proc.wait()


async def test_node_worker_serves_through_the_gateway_passes_worker_check_and_drains(node_worker, locked_bus,
                                                                                     locked_env, namespace):
    from services.commands.worker_check import check_worker

    gateway, tokenizer, registry = await admission_and_gateway(locked_bus, locked_env, namespace,
                                                               "the node worker in the registry")
    ids = tokenizer.encode("Hello tandem")
    expected = tokenizer.decode((ids * 3)[:5])
    eos = tokenizer.stop_token_ids[0]
    async with TestClient(TestServer(build_app(gateway))) as client:
        resp = await client.post("/v1/chat/completions", json={
            "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5})
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Tandem-Worker"] == "node-1"
        resp = await client.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "Hello tandem",
                                                          "max_tokens": 5, "stream": True})
        assert resp.status == 200 and expected.split()[0] in await resp.text()
        # the echo reaches the prompt's EOS token: the worker stops there, knowing it from the request alone
        prompt = [ids[0], eos, ids[1]]
        resp = await client.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 5})
        body = await resp.json()
        assert resp.status == 200, body
        assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 2, body
        resp = await client.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 5,
                                                          "ignore_eos": True})
        body = await resp.json()
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 5, body

    checks = await check_worker(locked_env, namespace, "node-1", prompt=[1, 2, 3], timeout_s=20)
    assert [c.line() for c in checks if c.outcome != "PASS"] == []
    assert any("note" not in c.reason for c in checks if c.name == "registry entry")  # the engine's namespace

    node_worker.terminate()
    assert node_worker.wait(30) == 0
    assert "drained and deregistered" in node_worker.stdout.read()
    await wait_until(lambda: _gone(registry, "node-1"), timeout_s=3, what="the node worker's entry deleted")


async def _gone(registry: WorkerRegistry, worker_id: str) -> bool:
    return worker_id not in {w.worker_id for w in await registry.list()}
