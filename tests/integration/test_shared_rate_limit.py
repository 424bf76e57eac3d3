"""One rate limit per API key across every gateway: two gateways that share one Redis admit a key
about ``burst + rate * elapsed`` requests in all, not twice that, whichever gateway each request
reaches; uploads and the file and batch lists count as much as generations; another key keeps its
own bucket. In-process on real NATS and Redis (two ``Gateway`` apps), then on a real stack
(``tandem up --gateways 2``, no workers: none is needed). With Redis gone a gateway falls back to
its own limit and never answers 5xx.

Slow: the gateway loads the real tokenizer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.batch_api import Batches
from services.gateway.config import GatewaySettings
from services.gateway.service import Gateway, build_app, load_tokenizer
from shared.bus import WorkerRegistry
from shared.model.registry import DEFAULT_MODEL
from shared.protocol import Subjects

pytestmark = pytest.mark.slow

BURST = 10
RATE_PER_S = 0.2  # a token per 5 s: a second or two of requests refills one or none
LIMITS = {"api_keys": "k1,k2,k3", "rate_limit_per_s": RATE_PER_S, "rate_limit_burst": BURST}

# one call of a key: (method, path, request keyword arguments), made afresh for each request
Call = Callable[[], tuple[str, str, dict]]


def tokenize() -> tuple[str, str, dict]:
    return "POST", "/tokenize", {"json": {"prompt": "hi"}}


def upload() -> tuple[str, str, dict]:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", b'{"custom_id": "a"}\n', filename="input.jsonl")
    return "POST", "/v1/files", {"data": form}


def list_files() -> tuple[str, str, dict]:
    return "GET", "/v1/files", {}


def list_batches() -> tuple[str, str, dict]:
    return "GET", "/v1/batches", {}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def send(session: aiohttp.ClientSession, base_url: str, call: Call, key: str) -> int:
    """The status of one call; a refusal must be the OpenAI-format 429 with ``Retry-After``."""
    method, path, kwargs = call()
    async with session.request(method, base_url + path, headers=bearer(key), **kwargs) as resp:
        body = await resp.json()
        if resp.status == 429:
            assert body["error"]["code"] == "rate_limit_exceeded", body
            assert int(resp.headers["Retry-After"]) >= 1
        else:
            assert resp.status == 200, (method, path, resp.status, body)
        return resp.status


async def spend(base_urls: list[str], calls: list[Call], key: str, num_requests: int) -> tuple[int, float, list[int]]:
    """``num_requests`` of ``key``, one after another, the i-th to ``base_urls[i % n]`` making
    ``calls[i % len(calls)]``; returns how many were admitted, the seconds from the first sent
    to the last answered (the script's refill window lies inside it), and every status."""
    statuses = []
    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        for i in range(num_requests):
            statuses.append(await send(session, base_urls[i % len(base_urls)], calls[i % len(calls)], key))
        elapsed_s = time.monotonic() - start
    return statuses.count(200), elapsed_s, statuses


def assert_one_limit(admitted: int, elapsed_s: float, what: str) -> None:
    """Admitted within 10% of one bucket's worth over ``elapsed_s`` (two gateways each with its
    own bucket would admit twice the burst)."""
    expected = BURST + RATE_PER_S * elapsed_s
    print(f"{what}: {admitted} admitted in {elapsed_s:.2f}s; one limit allows {expected:.1f}, "
          f"a limit per gateway {2 * BURST + 2 * RATE_PER_S * elapsed_s:.1f}")
    assert abs(admitted - expected) <= 0.1 * expected, (admitted, expected)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture
async def gateways(bus, nats_url, namespace, tokenizer):
    """``start(n, **settings)``: ``n`` gateways of one stack (the same namespace) on ``bus``, each
    with its Files and Batch APIs; their base URLs."""
    registry = await WorkerRegistry.open(bus, Subjects(namespace).workers_bucket, ttl_s=5.0)
    async with contextlib.AsyncExitStack() as stack:
        async def start(n: int, **settings) -> list[str]:
            urls = []
            for _ in range(n):
                gateway = Gateway(GatewaySettings(nats_url=nats_url, namespace=namespace, **settings),
                                  bus, registry, tokenizer)
                if gateway.rate_limiter is not None:
                    stack.push_async_callback(gateway.rate_limiter.aclose)
                app = build_app(gateway)
                (await Batches.open(gateway)).add_routes(app)
                client = TestClient(TestServer(app))
                await client.start_server()
                stack.push_async_callback(client.close)
                urls.append(str(client.make_url("")).rstrip("/"))
            return urls

        yield start


async def test_two_gateways_sharing_redis_admit_one_limit_per_key(gateways, redis_url):
    urls = await gateways(2, redis_url=redis_url, rate_limit_redis_timeout_s=2.0, **LIMITS)
    admitted, elapsed_s, _ = await spend(urls, [tokenize], "k1", 4 * BURST)
    assert_one_limit(admitted, elapsed_s, "in-process, /tokenize")
    admitted, elapsed_s, statuses = await spend(urls, [upload, list_files, list_batches], "k2", 4 * BURST)
    assert_one_limit(admitted, elapsed_s, "in-process, uploads and lists")
    assert 429 in statuses[::3]  # uploads were refused too
    assert (await spend(urls, [tokenize], "k3", 2))[0] == 2  # another key: its own full bucket


async def test_without_redis_each_gateway_limits_on_its_own_and_never_answers_5xx(gateways):
    """Redis configured but gone (a port nobody listens on): the local limit, a burst per gateway."""
    from services.stack.servers import free_port  # noqa: PLC0415

    gone = f"redis://127.0.0.1:{free_port()}/0"
    urls = await gateways(2, redis_url=gone, rate_limit_redis_timeout_s=0.5, **LIMITS)
    admitted, elapsed_s, statuses = await spend(urls, [tokenize, upload, list_files], "k1", 4 * BURST)
    assert set(statuses) == {200, 429}
    assert 2 * BURST <= admitted <= 2 * (BURST + RATE_PER_S * elapsed_s)  # each gateway's own bucket


@pytest.mark.long  # a stack of service processes: the suite's second step
async def test_a_stack_of_two_gateways_admits_one_limit_per_key_on_every_endpoint(
        nats_server, redis_server, tmp_path):
    """``tandem up --gateways 2`` passes its Redis to both gateways; a key alternating between
    them gets one limit, for tokenizing and for uploads and lists alike."""
    from stack_helpers import running_stack, stack_spec  # noqa: PLC0415

    spec = stack_spec(tmp_path / "stack", "r", nats_server, redis_server, num_decode=0, num_gateways=2,
                      model=DEFAULT_MODEL, gateway_flags={**LIMITS, "rate_limit_redis_timeout_s": 2.0})
    with running_stack(spec, ready_timeout_s=120) as stack:
        urls = stack.base_urls
        assert len(urls) == 2
        admitted, elapsed_s, _ = await spend(urls, [tokenize], "k1", 4 * BURST)
        assert_one_limit(admitted, elapsed_s, "stack, /tokenize")
        admitted, elapsed_s, statuses = await spend(urls, [upload, list_files, list_batches], "k2", 4 * BURST)
        assert_one_limit(admitted, elapsed_s, "stack, uploads and lists")
        assert 429 in statuses[::3]
        assert (await spend(urls, [tokenize], "k3", 2))[0] == 2
        assert not [line for line in stack.lines if "rate limit per gateway process" in line]
