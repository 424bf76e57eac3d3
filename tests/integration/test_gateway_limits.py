"""The gateway's request limits, in-process on real NATS: a body over ``max_request_bytes`` is a 413
and a client over its rate a 429 ``rate_limit_exceeded`` with ``Retry-After``, both in OpenAI's
error format. No worker is needed: both are answered before the request goes anywhere. Hostile
input (bodies nested past ``MAX_JSON_DEPTH``, ``logit_bias`` keys that are no token ids, lone
surrogates, numbers too large to be counts or to be read at all, keys without ``Bearer``, texts past
the ``/tokenize`` limits) is a 4xx, never a 500, and a batch of hostile lines completes with an error
per line (no line held for redelivery, no batch held in ``validating``). One test starts a stack of
gateways without workers: API keys never on a gateway's command line, /status behind the operator key.

Slow: the gateway loads the real tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.batch_api import Batches
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
        """A gateway on ``bus``; with a ``batch_*`` setting, also its Files and Batch APIs and its
        batch work (the sweep and the line runner)."""
        gateway = Gateway(GatewaySettings(nats_url=nats_url, namespace=namespace, **settings),
                          bus, registry, tok or tokenizer)
        app = build_app(gateway)
        if any(name.startswith("batch_") for name in settings):
            batches = await Batches.open(gateway)
            batches.add_routes(app)
            await stack.enter_async_context(batches.running())
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    async with contextlib.AsyncExitStack() as stack:
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


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize",
                                  "/detokenize"])
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


CHAT_BODY = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}]}
SURROGATE = r'"\ud800"'  # JSON for a lone surrogate: parsed, it is a str no tokenizer takes
HOSTILE = [  # (path, raw body, the param the 400 names): once 500s, or a request sent on to the workers
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {SURROGATE}}}]}}', "messages.0.content"),
    ("/v1/completions", f'{{"prompt": {SURROGATE}}}', "prompt"),
    ("/v1/responses", f'{{"input": [{{"role": "user", "content": {SURROGATE}}}]}}', "input.0.content"),
    ("/tokenize", f'{{"prompt": {SURROGATE}}}', "prompt"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": {SURROGATE}}}]}}', "messages.0.content"),
    ("/v1/chat/completions", json.dumps(CHAT_BODY)[:-1] + ', "max_tokens": ' + "9" * 4000 + "}", "max_tokens"),
    ("/v1/chat/completions", json.dumps(CHAT_BODY)[:-1] + ', "max_tokens": ' + "9" * 5000 + "}", None),
    ("/v1/chat/completions", json.dumps({**CHAT_BODY, "top_k": 2**31}), "top_k"),
    ("/v1/responses", json.dumps({"input": "hi", "max_output_tokens": 10**100}), "max_output_tokens"),
    ("/v1/chat/completions", json.dumps({**CHAT_BODY, "stop": ["x"] * 1000}), "stop"),
]


@pytest.mark.parametrize("path, body, param", HOSTILE)
async def test_a_hostile_body_is_a_400_naming_where_and_the_gateway_keeps_serving(client_for, path, body, param):
    client = await client_for()
    resp = await client.post(path, data=body.encode(), headers={"Content-Type": "application/json"})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert (await client.get("/health")).status == 200


async def test_too_many_stop_strings_names_the_limit(client_for):
    client = await client_for()
    resp = await client.post("/v1/chat/completions", json={**CHAT_BODY, "stop": ["x"] * 1000})
    assert "at most 4 stop strings are allowed, got 1000" in (await resp.json())["error"]["message"]


async def test_tokenize_and_detokenize_count_against_the_rate_limit(client_for):
    client = await client_for(api_keys="k1", rate_limit_per_s=RATE_PER_S, rate_limit_burst=BURST)
    assert (await client.post("/tokenize", json={"prompt": "hi"}, headers=bearer("k1"))).status == 200
    assert (await client.post("/detokenize", json={"tokens": [1]}, headers=bearer("k1"))).status == 200
    for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
        resp = await client.post(path, json=body, headers=bearer("k1"))
        assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
        assert (await resp.json())["error"]["code"] == "rate_limit_exceeded"


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


def batch_line(custom_id: str, body: str) -> str:
    return f'{{"custom_id": "{custom_id}", "method": "POST", "url": "/v1/chat/completions", "body": {body}}}'


HOSTILE_LINES = [  # run, each a 400 in the error file; a surrogate once sent its line back every ack wait
    json.dumps({**CHAT_BODY, "logit_bias": {"²": 1}}),
    json.dumps({**CHAT_BODY, "logit_bias": {"9" * 5000: 1}}),
    json.dumps({**CHAT_BODY, "stop": ["x"] * 1000}),
    json.dumps({**CHAT_BODY, "stream": True}),
    json.dumps(CHAT_BODY)[:-1] + ', "max_tokens": ' + "9" * 4000 + "}",
    f'{{"messages": [{{"role": "user", "content": {SURROGATE}}}]}}',
    '{"messages": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}",
]


async def test_a_batch_of_hostile_lines_completes_with_an_error_per_line(client_for):
    """In-process: the gateway's sweep and line runner on real NATS (no worker: every line is
    refused before it would need one)."""
    client = await client_for(batch_sweep_interval_s=0.2, batch_ack_wait_s=30)
    lines = [batch_line(f"c{i}", body) for i, body in enumerate(HOSTILE_LINES)]
    batch = await run_batch(client, lines)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": len(lines), "completed": 0, "failed": len(lines)}
    errors = (await (await client.get(f"/v1/files/{batch['error_file_id']}/content")).read()).decode().splitlines()
    assert [json.loads(e)["response"]["status_code"] for e in errors] == [400] * len(lines)


async def test_a_batch_line_python_cannot_parse_fails_the_batch_naming_it(client_for):
    """Once a ValueError out of every sweep: the batch stayed in validating for good."""
    client = await client_for(batch_sweep_interval_s=0.2)
    huge = json.dumps(CHAT_BODY)[:-1] + ', "max_tokens": ' + "9" * 5000 + "}"
    batch = await run_batch(client, [batch_line("a", json.dumps(CHAT_BODY)), batch_line("b", huge)])
    assert batch["status"] == "failed", batch
    assert [(e["code"], e["line"]) for e in batch["errors"]["data"]] == [("invalid_json_line", 2)]


async def run_batch(client: TestClient, lines: list[str], timeout_s: float = 20.0) -> dict:
    """Upload ``lines``, run them as a batch (the sweep and the runner of ``client``'s gateway) and
    return the batch once it ended, or as it is after ``timeout_s``."""
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", ("\n".join(lines) + "\n").encode(), filename="input.jsonl")
    file = await (await client.post("/v1/files", data=form)).json()
    resp = await client.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h"})
    batch = await resp.json()
    deadline = asyncio.get_running_loop().time() + timeout_s
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        if asyncio.get_running_loop().time() > deadline:
            return batch
        await asyncio.sleep(0.2)
        batch = await (await client.get(f"/v1/batches/{batch['id']}")).json()
    return batch


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


async def test_a_long_chat_prompt_does_not_hold_health(client_for, tokenizer):
    """The chat template and tokenization of a generation's prompt run off the event loop too."""
    held = HeldTokenizer(tokenizer)
    client = await client_for(tok=held, admission_timeout_s=0.2, admission_retry_s=0)
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hello world " * 20_000}]}
    generating = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    assert await asyncio.to_thread(held.entered.wait, 30)
    health = await client.get("/health")  # answered while the tokenizer still holds its thread
    assert health.status == 200 and not generating.done()
    held.released.set()
    resp = await generating  # tokenized; then no admission answers (there is none here)
    assert resp.status == 503


@pytest.mark.long  # a stack of service processes: the suite's second step
def test_a_stack_keeps_keys_off_gateway_command_lines_and_its_pages_behind_the_operator_key(
        nats_server, redis_server, tmp_path, capsys):
    """``tandem up --api-keys`` and an operator key file on a real stack (no workers: none is
    needed): ``ps`` shows no key, and our own readers of /status (the stack, ``tandem status``)
    send the operator key."""
    import argparse  # noqa: PLC0415
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    from services.commands.status import status_main  # noqa: PLC0415
    from stack_helpers import running_stack, stack_spec  # noqa: PLC0415

    operator_key = tmp_path / "operator.key"
    operator_key.write_text("op-stack-key\n")
    spec = stack_spec(tmp_path / "stack", "k", nats_server, redis_server, num_decode=0, num_gateways=2,
                      model=DEFAULT_MODEL,
                      gateway_flags={"api_keys": "sk-secret-1,sk-secret-2", "operator_key_file": str(operator_key)},
                      metrics_key_file=str(operator_key))
    with running_stack(spec, ready_timeout_s=120) as stack:
        gateways = [c for name, c in stack.children.items() if name.startswith("gateway")]
        assert len(gateways) == 2
        for child in gateways:
            cmdline = open(f"/proc/{child.pid}/cmdline", "rb").read().decode()
            assert "sk-secret" not in cmdline and "op-stack-key" not in cmdline, cmdline
        for url in stack.base_urls:
            tokenize = urllib.request.Request(url + "/tokenize", data=b'{"prompt": "hi"}',
                                              headers={"Authorization": "Bearer sk-secret-2"})
            with urllib.request.urlopen(tokenize, timeout=10) as resp:  # the keys arrived by the environment
                assert resp.status == 200
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(url + "/status", timeout=10)
            assert refused.value.code == 401
        assert stack.listed_pids()  # the stack's own reader sends the key
        args = argparse.Namespace(url=stack.base_url, json=True, operator_key_file=str(operator_key))
        assert status_main(args) == 0
        services = json.loads(capsys.readouterr().out)["services"]
        assert {s["service"] for s in services} >= {"gateway", "admission", "kv-index"}
        for service in services:  # every process's own /metrics listener wants the key too
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(service["metrics_url"], timeout=10)
            assert refused.value.code == 401, service
            scrape = urllib.request.Request(service["metrics_url"], headers={"Authorization": "Bearer op-stack-key"})
            with urllib.request.urlopen(scrape, timeout=10) as resp:
                assert resp.status == 200 and b"# TYPE" in resp.read()
