"""A unique namespace per test, over the session's real nats-server (JetStream) and redis-server
(``nats_server`` and ``redis_server``: tests/conftest.py)."""

from __future__ import annotations

import uuid

import pytest


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


@pytest.fixture(scope="module")
def one_worker_stack(nats_server, redis_server, tmp_path_factory):
    """A stack of the test module's own: one CPU decode worker of SmolLM2-135M (1024 tokens, 64 MiB
    of KV cache), as the API client tests (test_openai_sdk, test_agent_clients, ...) need."""
    from stack_helpers import running_stack, stack_spec  # noqa: PLC0415

    spec = stack_spec(tmp_path_factory.mktemp("stack"), "w", nats_server, redis_server, num_decode=1,
                      model="smollm2-135m", decode_flags={"max_model_len": 1024, "kv_cache_memory": "64MiB",
                                                          "device": "cpu", "num_warmup_requests": 1})
    with running_stack(spec, ready_timeout_s=180) as s:
        yield s


@pytest.fixture(scope="session")
def heads_32(tmp_path_factory):
    """A 2-layer random model with 32 heads and 8 KV heads and SmolLM2's tokenizer, as a Hugging Face
    directory: cheap to load and run, and TP=2 or PP=2 splits it."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    path = tmp_path_factory.mktemp("heads-32")
    subprocess.run([sys.executable, "-m", "loadtest.tools.synth_model", "--shape", "heads-32", "--format", "hf",
                    "--out", str(path)], check=True, capture_output=True)
    return path
