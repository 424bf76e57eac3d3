"""The gateway in-process (aiohttp test server) with in-process admission on real NATS: API keys,
and admission's rejections as 503/429 with Retry-After in OpenAI error format. The 429 comes from a
real decode worker process whose queue real requests fill.

Slow: the gateway loads the real tokenizer, and the overload test starts a real decode worker.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.admission.config import AdmissionSettings
from services.admission.service import AdmissionService
from services.gateway.config import GatewaySettings
from services.gateway.service import Gateway, build_app, load_tokenizer
from services.stack.children import Child, child_env, service_argv
from services.stack.waiting import wait_until
from shared.bus import WorkerRegistry
from shared.model.registry import DEFAULT_MODEL
from shared.protocol import Subjects
from shared.telemetry.metrics import sample_total

pytestmark = pytest.mark.slow

BODY = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
AUTH = {"Authorization": "Bearer k1"}
TTL_S = 5.0


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture
async def setup(bus, nats_url, namespace, tokenizer, tmp_path):
    """Gateway and admission as the services run them: live registry copies refreshed in the
    background (a registry opened without ``watch`` may list a just-written entry late)."""
    qos = tmp_path / "qos.yaml"
    qos.write_text("default_tier: default\ntiers: {gold: {priority: 0}, default: {priority: 1}}\n")
    common = dict(nats_url=nats_url, namespace=namespace, registry_ttl_s=TTL_S, qos=str(qos))
    registry = await WorkerRegistry.open(bus, Subjects(namespace).workers_bucket, ttl_s=TTL_S, watch=True)
    admission = AdmissionService(AdmissionSettings(max_waiting_per_worker=1, retry_after_s=3, **common),
                                 bus, registry)
    await admission.start()
    gateway = Gateway(GatewaySettings(api_keys="k1:gold,k2", **common), bus, registry, tokenizer)
    tasks = [asyncio.create_task(admission.run_forever()), asyncio.create_task(gateway.run_forever())]
    client = TestClient(TestServer(build_app(gateway)))
    await client.start_server()
    yield client, gateway, admission
    await client.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
def decode_worker(nats_url, namespace):
    """A real decode worker that runs one sequence at a time, so a second request queues."""
    lines: list[str] = []
    worker_id = f"{namespace}-decode"
    child = Child("decode", service_argv("decode", {
        "nats_url": nats_url, "namespace": namespace, "registry_ttl_s": TTL_S, "worker_id": worker_id,
        "model": DEFAULT_MODEL, "device": "cpu", "max_model_len": 1024, "kv_cache_memory": "64MiB",
        "max_num_seqs": 1, "num_warmup_requests": 1, "load_interval_s": 0.2, "remote_prefill": False}),
        child_env(), lambda name, line: lines.append(line))
    child.lines = lines
    child.worker_id = worker_id
    yield child
    child.kill()
    child.wait(10)


async def test_api_keys(setup):
    client, gateway, _ = setup
    resp = await client.post("/v1/chat/completions", json=BODY)
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    resp = await client.post("/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer nope"})
    assert resp.status == 401
    assert gateway.api_keys.key_tiers == {"k1": "gold", "k2": "default"}


async def test_no_worker_is_503_with_retry_after(setup):
    client = setup[0]
    resp = await client.post("/v1/chat/completions", json=BODY, headers=AUTH)
    assert resp.status == 503 and resp.headers["Retry-After"] == "3"
    assert (await resp.json())["error"]["code"] == "unavailable"
    assert (await client.get("/ready")).status == 503


async def test_a_full_queue_on_a_real_worker_is_429_with_retry_after(setup, decode_worker):
    client, gateway, admission = setup
    worker_id = decode_worker.worker_id

    async def ready():
        assert decode_worker.is_running(), "\n".join(decode_worker.lines[-30:])
        return gateway.ready_workers() and admission.view.ready_workers("decode")

    await wait_until(ready, timeout_s=180, what=f"{worker_id} ready at the gateway and admission")
    long = {"model": DEFAULT_MODEL, "prompt": "Count slowly: one, two,", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    running = await client.post("/v1/completions", json=long, headers=AUTH)  # returns at its first token
    assert running.status == 200 and running.headers["X-Tandem-Worker"] == worker_id

    def reported(num_running: int, num_waiting: int) -> bool:
        entry = admission.view.get(worker_id)
        return entry is not None and entry.load is not None and \
            (entry.load.num_running, entry.load.num_waiting) == (num_running, num_waiting)

    async def running_alone():  # a report from before its prefill (waiting 1) would refuse the next
        return reported(1, 0)

    await wait_until(running_alone, timeout_s=30, what=f"{worker_id} reporting the first request running")
    queued = asyncio.create_task(client.post("/v1/completions", json=long, headers=AUTH))

    async def queue_full():
        assert not queued.done(), "the second request did not queue behind the first"
        return reported(1, 1)

    try:
        await wait_until(queue_full, timeout_s=30, what=f"{worker_id} reporting a queued request")
        try:  # admitted, it would wait behind the 900-token request
            resp = await asyncio.wait_for(client.post("/v1/chat/completions", json=BODY, headers=AUTH), 60)
        except TimeoutError:
            pytest.fail("a request to the full worker was admitted (no answer in 60s) instead of a 429")
        assert resp.status == 429, await resp.text()
        assert resp.headers["Retry-After"] == "3"
        assert (await resp.json())["error"]["type"] == "rate_limit_exceeded"
        metrics = await (await client.get("/metrics")).text()
        assert sample_total(metrics, "tandem_gateway_rejected_total", reason="overloaded", tier="gold") == 1
        assert sample_total(metrics, "tandem_gateway_requests_total", status="429") == 1
    finally:
        running.close()  # the gateway cancels both at the worker when their clients go
        queued.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await queued
