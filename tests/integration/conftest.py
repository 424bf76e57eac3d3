"""Real nats-server (JetStream) and redis-server per test session; a unique namespace per test.

Servers pick or get free loopback ports and are ready when they print their readiness line.
"""

from __future__ import annotations

import uuid

import pytest

from services.stack.servers import start_nats_server, start_redis_server


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    server = start_nats_server(tmp_path_factory.mktemp("nats"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = start_redis_server(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def namespace() -> str:
    """Subjects, streams, buckets and Redis keys of this test only."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def bus(nats_url):
    from shared.bus import Bus

    b = await Bus.connect(nats_url, "test")
    yield b
    await b.close()
