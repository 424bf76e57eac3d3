"""The gateway in-process (aiohttp test server) with in-process admission on real NATS: API keys,
and admission's rejections as 503/429 with Retry-After in OpenAI error format."""

import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.admission.config import AdmissionSettings
from services.admission.service import AdmissionService
from services.gateway.config import GatewaySettings
from services.gateway.service import Gateway, build_app, load_tokenizer
from shared.bus import WorkerRegistry
from shared.model.registry import DEFAULT_MODEL
from shared.protocol import Subjects, WorkerInfo, WorkerLoad
from shared.runtime.waiting import wait_until

BODY = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture
async def setup(bus, nats_url, namespace, tokenizer):
    common = dict(nats_url=nats_url, namespace=namespace, registry_ttl_s=5.0)
    registry = await WorkerRegistry.open(bus, Subjects(namespace).workers_bucket, ttl_s=5.0)
    admission = AdmissionService(AdmissionSettings(max_waiting_per_worker=1, retry_after_s=3, **common),
                                 bus, registry)
    await admission.start()
    gateway = Gateway(GatewaySettings(api_keys="k1:gold,k2", **common), bus, registry, tokenizer)
    client = TestClient(TestServer(build_app(gateway)))
    await client.start_server()
    yield client, gateway, registry, admission
    await client.close()


async def test_api_keys(setup):
    client = setup[0]
    resp = await client.post("/v1/chat/completions", json=BODY)
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    resp = await client.post("/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer nope"})
    assert resp.status == 401
    assert setup[1]._key_tiers == {"k1": "gold", "k2": "default"}


async def test_no_worker_is_503_and_full_queues_are_429_with_retry_after(setup, bus, namespace):
    client, gateway, registry, admission = setup
    auth = {"Authorization": "Bearer k1"}
    resp = await client.post("/v1/chat/completions", json=BODY, headers=auth)
    assert resp.status == 503 and resp.headers["Retry-After"] == "3"
    assert (await resp.json())["error"]["code"] == "unavailable"
    assert (await client.get("/ready")).status == 503

    subjects = Subjects(namespace)
    await registry.put(WorkerInfo(worker_id="w1", role="decode", model=DEFAULT_MODEL, block_size=16,
                                  max_model_len=2048, generate_subject=subjects.decode_generate("w1").subject,
                                  cancel_subject=subjects.decode_cancel("w1").subject,
                                  kv_namespace_hex=b"x".hex()))
    await admission.refresh()
    await bus.publish(subjects.load("decode", "w1"), WorkerLoad(
        worker_id="w1", role="decode", seq=1, timestamp=time.time(), num_waiting=1))

    async def loaded():
        return all(e.load for e in admission.view.ready_workers("decode"))

    await wait_until(loaded, timeout_s=5, what="w1's load at admission")
    resp = await client.post("/v1/chat/completions", json=BODY, headers=auth)
    assert resp.status == 429, await resp.text()  # the body says which 5xx path it took instead
    assert resp.headers["Retry-After"] == "3"
    assert (await resp.json())["error"]["type"] == "rate_limit_exceeded"
    metrics = await (await client.get("/metrics")).text()
    assert 'tandem_gateway_rejected_total{reason="overloaded"} 1' in metrics
    assert 'tandem_gateway_requests_total{status="429"} 1' in metrics
