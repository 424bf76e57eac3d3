"""The gateway's request limits, in-process on real NATS: a body over ``max_request_bytes`` is a 413
and a client over its rate a 429 ``rate_limit_exceeded`` with ``Retry-After``, both in OpenAI's
error format. No worker is needed: both are answered before the request goes anywhere. Hostile
input (bodies nested past ``MAX_JSON_DEPTH``, ``logit_bias`` keys that are no token ids, keys
without ``Bearer``, texts past the ``/tokenize`` limits) is a 4xx, never a 500.

Slow: the gateway loads the real tokenizer.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.config import GatewaySettings
from services.gateway.service import Gateway, build_app, load_tokenizer
from shared.bus import WorkerRegistry
from shared.model.registry import DEFAULT_MODEL
from shared.openai_api.json_body import MAX_JSON_DEPTH
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

    async def start(tok=None, **settings) -> TestClient:
        gateway = Gateway(GatewaySettings(nats_url=nats_url, namespace=namespace, **settings),
                          bus, registry, tok or tokenizer)
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


def nested(depth: int) -> bytes:
    """A body nested ``depth`` levels deep: ``{"model": ..., "messages": [[[...]]]}``."""
    return (b'{"model": "' + DEFAULT_MODEL.encode() + b'", "messages": ' + b"[" * (depth - 1)
            + b"]" * (depth - 1) + b"}")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 10_000])  # 10,000 levels were a 500 RecursionError
async def test_a_body_nested_too_deep_is_400(client_for, path, depth):
    client = await client_for()
    resp = await client.post(path, data=nested(depth), headers={"Content-Type": "application/json"})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json")
    assert f"deeper than {MAX_JSON_DEPTH} levels" in error["message"]


@pytest.mark.parametrize("key", ["²", "9" * 5000, "-1", "1e3", str(10**9)])  # "²" and 5,000 digits were 500s
@pytest.mark.parametrize("path, prompt", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                          ("/v1/completions", {"prompt": "hi"})])
async def test_a_logit_bias_key_that_is_no_token_id_is_400_naming_it(client_for, key, path, prompt):
    client = await client_for()
    resp = await client.post(path, json={"model": DEFAULT_MODEL, **prompt, "logit_bias": {key: 1}})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "logit_bias")


async def test_tokenize_and_detokenize_need_the_key_and_bound_their_size(client_for):
    client = await client_for(api_keys="k1", max_tokenize_chars=100, max_detokenize_tokens=10)
    for path, body in [("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [1, 2]})]:
        for headers in ({}, {"Authorization": "k1"}, bearer("k2")):  # none, no "Bearer ", unknown
            resp = await client.post(path, json=body, headers=headers)
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
        assert (await client.post(path, json=body, headers=bearer("k1"))).status == 200
    for path, body, param in [("/tokenize", {"prompt": "x" * 101}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "user", "content": "x" * 101}]}, "messages"),
                              ("/detokenize", {"tokens": [1] * 11}, "tokens")]:
        resp = await client.post(path, json=body, headers=bearer("k1"))
        assert resp.status == 413
        error = (await resp.json())["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, "input_too_large")


async def test_a_bare_key_is_refused_on_v1_too(client_for):
    client = await client_for(api_keys="k1")
    invalid = {"model": DEFAULT_MODEL, "messages": []}  # past auth: a 400
    assert (await client.post("/v1/chat/completions", json=invalid, headers={"Authorization": "k1"})).status == 401
    assert (await client.post("/v1/chat/completions", json=invalid, headers=bearer("k1"))).status == 400


class HeldTokenizer:
    """The real tokenizer, but ``encode`` waits until the test lets it go: a long tokenization."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.entered, self.released = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, *args, **kwargs):
        self.entered.set()
        self.released.wait(30)  # bounded: run on the event loop, the test fails rather than hangs
        return self._inner.encode(*args, **kwargs)


async def test_a_long_tokenize_does_not_hold_health(client_for, tokenizer):
    held = HeldTokenizer(tokenizer)
    client = await client_for(tok=held)
    tokenizing = asyncio.create_task(client.post("/tokenize", json={"prompt": "hello world " * 20_000}))
    assert await asyncio.to_thread(held.entered.wait, 30)
    health = await client.get("/health")  # answered while the tokenizer still holds its thread
    assert health.status == 200 and not tokenizing.done()
    held.released.set()
    resp = await tokenizing
    assert resp.status == 200 and (await resp.json())["count"] > 20_000
