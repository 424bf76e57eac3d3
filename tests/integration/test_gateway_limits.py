"""The gateway's request limits, in-process on real NATS: a body over ``max_request_bytes`` is a 413
and a client over its rate a 429 ``rate_limit_exceeded`` with ``Retry-After``, both in OpenAI's
error format. No worker is needed: both are answered before the request goes anywhere.

Slow: the gateway loads the real tokenizer.
"""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.config import GatewaySettings
from services.gateway.service import Gateway, build_app, load_tokenizer
from shared.bus import WorkerRegistry
from shared.model.registry import DEFAULT_MODEL
from shared.protocol import Subjects

pytestmark = pytest.mark.slow

RATE_PER_S = 0.01  # one token per 100 s: nothing refills while the test runs
BURST = 2


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture
async def client_for(bus, nats_url, namespace, tokenizer):
    registry = await WorkerRegistry.open(bus, Subjects(namespace).workers_bucket, ttl_s=5.0)
    clients = []

    async def start(**settings) -> TestClient:
        gateway = Gateway(GatewaySettings(nats_url=nats_url, namespace=namespace, **settings),
                          bus, registry, tokenizer)
        client = TestClient(TestServer(build_app(gateway)))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_body_over_max_request_bytes_is_413(client_for):
    client = await client_for(max_request_bytes=1024)
    small = {"model": DEFAULT_MODEL, "messages": []}  # under the limit: read, then refused as invalid
    resp = await client.post("/v1/chat/completions", json=small)
    assert resp.status == 400
    big = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "x" * 2000}]}
    resp = await client.post("/v1/chat/completions", json=big)
    assert resp.status == 413
    assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_a_key_over_its_rate_is_429_with_retry_after_and_other_keys_are_not(client_for):
    client = await client_for(api_keys="k1,k2", rate_limit_per_s=RATE_PER_S, rate_limit_burst=BURST)
    invalid = {"model": DEFAULT_MODEL, "messages": []}  # passes the limiter, then a 400
    for _ in range(BURST):
        assert (await client.post("/v1/chat/completions", json=invalid, headers=bearer("k1"))).status == 400
    resp = await client.post("/v1/completions", json=invalid, headers=bearer("k1"))
    assert resp.status == 429
    assert (await resp.json())["error"]["code"] == "rate_limit_exceeded"
    # the wait for the next token: just under 1 / RATE_PER_S, rounded up to whole seconds
    assert 1 <= int(resp.headers["Retry-After"]) <= 1 / RATE_PER_S
    assert (await client.post("/v1/chat/completions", json=invalid, headers=bearer("k2"))).status == 400
    # an unknown key is turned away before it can spend anyone's tokens
    assert (await client.post("/v1/chat/completions", json=invalid, headers=bearer("k3"))).status == 401


async def test_without_keys_the_rate_is_per_client_and_off_by_default(client_for):
    limited = await client_for(rate_limit_per_s=RATE_PER_S, rate_limit_burst=1)
    invalid = {"model": DEFAULT_MODEL, "messages": []}
    assert (await limited.post("/v1/chat/completions", json=invalid)).status == 400
    resp = await limited.post("/v1/chat/completions", json=invalid)
    assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
    unlimited = await client_for()
    for _ in range(20):
        assert (await unlimited.post("/v1/chat/completions", json=invalid)).status == 400
