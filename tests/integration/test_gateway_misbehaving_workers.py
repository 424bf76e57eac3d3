"""The gateway against decode workers that break the protocol, over a real nats-server with the real
admission service and the gateway's HTTP app: the workers are plain nats-py subscribers writing raw
bytes, as a worker in another language would.

Each misbehaviour (a chunk that does not parse, such as ``finish_reason: "eos"``; the end marker
before any chunk or before the last one; silence past the token deadline) is either re-admission to
another worker (the client sees a normal answer) or, when there is none, a 502 with an OpenAI error
body (mid-stream: an error event, then ``[DONE]``). Never a 500, never a stream cut without an
error. The worker is told in the cancel's reason, and the gateway counts it by worker and reason.
Ties between idle workers go to the lower id, so ``a-bad`` is always tried before ``b-good``.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from loadtest.tools import sse
from services.admission.config import AdmissionSettings
from services.admission.service import AdmissionService
from services.gateway.config import GatewaySettings
from services.gateway.service import Gateway, build_app
from services.stack.waiting import wait_until
from shared.bus import WorkerRegistry
from shared.protocol import Subjects, WorkerInfo
from shared.telemetry.metrics import sample_total

MODEL = "m"
BAD, GOOD = "a-bad", "b-good"
TTL_S = 5.0
SLOW_S = 1.5


def tokenizer():
    from shared.tokenizer import Tokenizer

    backend = BackendTokenizer(WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend, bos_token=None, eos_token=None, chat_template="")


class RawWorker:
    """A decode worker on raw NATS. ``behaviour``: ``good`` streams tokens 10, 11, ... (after
    the tokens a moved request already has) up to max_tokens; ``bad_finish`` sends one chunk whose finish_reason is "eos"; ``no_chunk`` sends the
    end marker first; ``cut`` sends two good chunks then the end marker; ``garbage`` two good
    chunks then bytes that are not JSON; ``silent`` two good chunks, then nothing; ``lost`` nothing,
    and it says it does not run the request when asked (as if the request never reached it: core
    NATS drops a message whose route died); ``slow`` says it runs the request, then answers as
    ``good`` after ``SLOW_S``; ``slow_garbled`` the same, its status replies unparseable."""

    def __init__(self, worker_id: str, behaviour: str, namespace: str, kv_namespace_hex: str = "") -> None:
        self.worker_id, self.behaviour = worker_id, behaviour
        self.subjects = Subjects(namespace)
        self.kv_namespace_hex = kv_namespace_hex
        self.requests: list[dict] = []
        self.cancels: list[dict] = []
        self.asked: list[str] = []  # the request ids the gateway asked about (control status)
        self._running: set[str] = set()
        self._release = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    async def start(self, bus, registry: WorkerRegistry) -> None:
        nc = bus.nc
        generate = self.subjects.decode_generate(self.worker_id).subject
        cancel = self.subjects.decode_cancel(self.worker_id).subject
        async def on_generate(msg) -> None:  # one task per request: never block the subscription
            task = asyncio.create_task(self._serve(nc, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        async def on_control(msg) -> None:
            req = json.loads(msg.data)
            self.asked.append(req.get("request_id"))
            if self.behaviour == "slow_garbled":  # a status reply that does not parse says nothing
                await nc.publish(msg.reply, b'{"holds_request": "perhaps"}')
                return
            await nc.publish(msg.reply, json.dumps({
                "worker_id": self.worker_id, "state": "ready",
                "holds_request": None if req.get("request_id") is None else req["request_id"] in self._running,
            }).encode())

        await nc.subscribe(generate, cb=on_generate)
        await nc.subscribe(cancel, cb=self._on_cancel)
        await nc.subscribe(self.subjects.control(self.worker_id).subject, cb=on_control)
        await registry.put(WorkerInfo(worker_id=self.worker_id, role="decode", model=MODEL, block_size=4,
                                      max_model_len=256, max_num_seqs=8, generate_subject=generate,
                                      cancel_subject=cancel, kv_namespace_hex=self.kv_namespace_hex,
                                      started_at=time.time()))

    async def _on_cancel(self, msg) -> None:
        self.cancels.append(json.loads(msg.data))

    async def _serve(self, nc, msg) -> None:
        req = json.loads(msg.data)
        self.requests.append(req)
        if self.behaviour == "lost":
            return
        self._running.add(req["request_id"])
        try:
            await self._answer(nc, msg, req)
        finally:
            self._running.discard(req["request_id"])

    async def _answer(self, nc, msg, req: dict) -> None:
        rid, max_tokens = req["request_id"], req["sampling"]["max_tokens"]
        first = 10 + req["sampling"].get("num_output_in_prompt", 0)  # a moved request goes on from there

        def chunk(i: int, finish: str | None = None) -> bytes:
            return json.dumps({"request_id": rid, "index": i, "token_ids": [first + i], "finish_reason": finish,
                               "num_prompt_tokens": len(req["prompt_token_ids"]), "worker_id": self.worker_id,
                               # as Tandem's CPU worker: from its first decode row on
                               "decode_path": "eager" if i else None}).encode()

        end = {"Tandem-Stream": "end"}
        if self.behaviour in ("slow", "slow_garbled"):
            await asyncio.sleep(SLOW_S)
        if self.behaviour in ("good", "slow", "slow_garbled"):
            for i in range(max_tokens):
                await nc.publish(msg.reply, chunk(i, "length" if i == max_tokens - 1 else None))
        elif self.behaviour == "bad_finish":
            await nc.publish(msg.reply, chunk(0, "eos"))
        elif self.behaviour in ("cut", "garbage", "silent"):
            for i in range(2):
                await nc.publish(msg.reply, chunk(i))
            if self.behaviour == "garbage":
                await nc.publish(msg.reply, b"<html>502 Bad Gateway</html>")
            elif self.behaviour == "silent":
                await self._release.wait()
                return
        await nc.publish(msg.reply, b"", headers=end)

    def stop(self) -> None:
        self._release.set()


@pytest.fixture
async def cluster(bus, nats_url, namespace):
    """Start the named raw workers, then admission and the gateway; yields (client, gateway, workers)."""
    registry = await WorkerRegistry.open(bus, Subjects(namespace).workers_bucket, ttl_s=TTL_S, watch=True)
    tasks: list[asyncio.Task] = []
    clients: list[TestClient] = []
    workers: list[RawWorker] = []

    async def start(*specs: tuple[str, str], **gateway_settings):
        common = dict(nats_url=nats_url, namespace=namespace, registry_ttl_s=TTL_S, refresh_interval_s=0.1)
        for worker_id, behaviour, *hex_ in specs:
            worker = RawWorker(worker_id, behaviour, namespace, *hex_)
            await worker.start(bus, registry)
            workers.append(worker)
        admission = AdmissionService(AdmissionSettings(**common), bus, registry)
        await admission.start()
        gateway = Gateway(GatewaySettings(model=MODEL, **common, **gateway_settings), bus, registry, tokenizer())
        tasks.extend(asyncio.create_task(s.run_forever()) for s in (admission, gateway))
        await wait_until(lambda: _listed(gateway, len(specs)), timeout_s=10, what="the workers in the registry")
        client = TestClient(TestServer(build_app(gateway)))
        await client.start_server()
        clients.append(client)
        return client, gateway, {w.worker_id: w for w in workers}

    yield start
    for worker in workers:
        worker.stop()
    for client in clients:
        await client.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _listed(gateway: Gateway, n: int) -> bool:
    await gateway.refresh()
    return len(gateway.ready_workers()) == n


def body(**extra) -> dict:
    return {"model": MODEL, "prompt": "t1 t2 t3 t4 t5 t6 t7 t8 t9", "max_tokens": 4, "temperature": 0, **extra}


GOOD_TEXT = " t10 t11 t12 t13"


def worker_errors(gateway: Gateway, worker_id: str, reason: str) -> float:
    from prometheus_client import generate_latest

    return sample_total(generate_latest(gateway.metrics.registry).decode(), "tandem_gateway_worker_errors_total",
                        worker=worker_id, reason=reason)


async def sse_events(resp) -> list:
    """Every ``data:`` payload of the stream, parsed (``[DONE]`` kept as the string)."""
    return list(sse.events((await resp.text()).splitlines()))


@pytest.mark.parametrize("behaviour,reason", [("bad_finish", "malformed_chunk"), ("no_chunk", "early_end")])
async def test_a_worker_failing_before_its_first_chunk_is_replaced_by_another(cluster, behaviour, reason):
    client, gateway, workers = await cluster((BAD, behaviour), (GOOD, "good"))
    resp = await client.post("/v1/completions", json=body())
    answer = await resp.json()
    assert resp.status == 200, answer
    assert resp.headers["X-Tandem-Worker"] == GOOD
    assert answer["choices"][0]["text"] == GOOD_TEXT
    assert len(workers[BAD].requests) == 1 and len(workers[GOOD].requests) == 1
    assert workers[GOOD].requests[0]["exclude_workers"] == [BAD]
    # the bad worker was told why, by request id
    assert [c["request_id"] for c in workers[BAD].cancels] == [workers[BAD].requests[0]["request_id"]]
    assert workers[BAD].cancels[0]["reason"].startswith(f"gateway: {reason}: ")
    assert worker_errors(gateway, BAD, reason) == 1


async def test_a_request_lost_on_the_way_to_its_worker_is_admitted_again(cluster):
    """The worker never got the request (it says so, twice): admitted again, answered by another,
    long before the 600 s first-token timeout."""
    client, gateway, workers = await cluster((BAD, "lost"), (GOOD, "good"), lost_request_check_s=0.2)
    resp = await client.post("/v1/completions", json=body())
    answer = await resp.json()
    assert resp.status == 200, answer
    assert resp.headers["X-Tandem-Worker"] == GOOD and answer["choices"][0]["text"] == GOOD_TEXT
    lost_id = workers[BAD].requests[0]["request_id"]
    assert workers[BAD].asked[:2] == [lost_id, lost_id]
    assert [c["request_id"] for c in workers[BAD].cancels] == [lost_id]  # in case it turns up after all
    assert not worker_errors(gateway, BAD, "timeout")  # a loss, not a misbehaviour


@pytest.mark.parametrize("behaviour", ["slow", "slow_garbled"])
async def test_a_worker_that_runs_the_request_is_waited_for(cluster, behaviour):
    """A worker slow to its first token keeps the request when it says it runs it, or when its
    answer says nothing (does not parse): asked, never abandoned."""
    client, gateway, workers = await cluster((BAD, behaviour), (GOOD, "good"), lost_request_check_s=0.2)
    resp = await client.post("/v1/completions", json=body())
    answer = await resp.json()
    assert resp.status == 200, answer
    assert resp.headers["X-Tandem-Worker"] == BAD and answer["choices"][0]["text"] == GOOD_TEXT
    assert len(workers[BAD].asked) >= 3 and not workers[GOOD].requests and not workers[BAD].cancels


@pytest.mark.parametrize("stream", [False, True])
async def test_an_unknown_finish_reason_from_the_only_worker_is_a_502_naming_it(cluster, stream):
    client, gateway, workers = await cluster((BAD, "bad_finish"))
    resp = await client.post("/v1/completions", json=body(stream=stream))
    answer = await resp.json()  # before the first token: a plain error body, streaming or not
    assert resp.status == 502, answer
    assert answer["error"]["code"] == "bad_worker_response"
    assert BAD in answer["error"]["message"] and "finish_reason" in answer["error"]["message"]
    assert len(workers[BAD].requests) == 1  # excluded: not asked again
    assert worker_errors(gateway, BAD, "malformed_chunk") == 1


@pytest.mark.parametrize("behaviour,reason", [("cut", "early_end"), ("garbage", "malformed_chunk"),
                                              ("silent", "timeout")])
async def test_a_worker_failing_mid_stream_is_continued_on_another(cluster, behaviour, reason):
    client, gateway, workers = await cluster((BAD, behaviour), (GOOD, "good"), token_idle_timeout_s=1.0)
    resp = await client.post("/v1/completions", json=body(stream=True))
    assert resp.status == 200
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    # t10 t11 from the bad worker, then the good one continues from there
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == GOOD_TEXT
    moved = workers[GOOD].requests[0]
    assert moved["prompt_token_ids"][-2:] == [10, 11] and moved["sampling"]["max_tokens"] == 2
    # the path the bad worker said it decoded on goes with the request (none on the first one)
    assert moved["sampling"]["decode_path"] == "eager"
    assert workers[BAD].requests[0]["sampling"].get("decode_path") is None
    assert moved["exclude_workers"] == [BAD]
    assert workers[BAD].cancels[0]["reason"].startswith(f"gateway: {reason}: ")
    assert worker_errors(gateway, BAD, reason) == 1


async def test_a_malformed_chunk_mid_stream_with_no_other_worker_ends_in_an_error_event_then_done(cluster):
    client, gateway, workers = await cluster((BAD, "garbage"))
    resp = await client.post("/v1/completions", json=body(stream=True))
    assert resp.status == 200  # the status line went with the first token
    events = await sse_events(resp)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "bad_worker_response", events
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")) == " t10 t11"


async def test_a_worker_whose_namespace_is_not_hex_is_routed_on_load(cluster):
    client, gateway, workers = await cluster((GOOD, "good", "not-hex!"))
    resp = await client.post("/v1/completions", json=body())
    assert resp.status == 200, await resp.text()
    assert workers[GOOD].requests[0]["block_hashes"] == []


async def test_a_request_given_up_before_its_first_token_is_cancelled_at_its_worker(cluster):
    """A background response or batch line cancelled while its worker has not answered yet (here
    the worker takes ``SLOW_S`` to its first token): the worker is told, by request id, instead of
    running the request to max_tokens for nobody."""
    from shared.openai_api.adapters import CompletionAdapter
    from shared.policy.qos import DEFAULT_TIER

    client, gateway, workers = await cluster((BAD, "slow"))
    api = CompletionAdapter.from_json(json.dumps(body()).encode(), gateway.tokenizer)
    gen_request = gateway.generate_request(api, DEFAULT_TIER, time.time())
    run = asyncio.create_task(gateway.collect(api, gen_request))
    await wait_until(lambda: workers[BAD].requests, timeout_s=10, what="the request at the worker")
    assert not workers[BAD].cancels
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    await wait_until(lambda: workers[BAD].cancels, timeout_s=10, what="the cancel at the worker")
    assert [c["request_id"] for c in workers[BAD].cancels] == [workers[BAD].requests[0]["request_id"]]


async def test_an_http_client_that_hangs_up_before_its_first_token_has_its_request_cancelled(cluster):
    """Served as ``tandem up`` serves it (``http_site``: a handler is cancelled when its client goes), a
    client that gives up while the worker has not answered yet: the worker is told."""
    import aiohttp

    from services.gateway.server import http_site

    _, gateway, workers = await cluster((BAD, "slow"))
    async with http_site(build_app(gateway), "127.0.0.1", 0) as port, aiohttp.ClientSession() as session:
        post = asyncio.ensure_future(session.post(f"http://127.0.0.1:{port}/v1/completions", json=body()))
        await wait_until(lambda: workers[BAD].requests, timeout_s=10, what="the request at the worker")
        post.cancel()  # the client hangs up
        await asyncio.gather(post, return_exceptions=True)
        await wait_until(lambda: workers[BAD].cancels, timeout_s=10, what="the cancel at the worker")
    assert [c["request_id"] for c in workers[BAD].cancels] == [workers[BAD].requests[0]["request_id"]]
