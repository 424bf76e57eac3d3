"""The decode worker's remote-prefill failure paths against a real JetStream server: a full prefill
queue, a refused publish and an unreadable queue state each end in a local prefill that still
produces the request's tokens, counted where the worker reports it (``num_local_prefills`` when the
policy kept the prompt local, ``num_prefill_fallbacks`` when a reservation was given up). A decode
worker over a tiny random-weight engine; no prefill worker process, no NIXL."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import pytest
import torch

from services.decode.config import DecodeSettings
from services.decode.remote import RemotePrefiller
from services.decode.service import DecodeWorker
from services.framework.lifecycle import every
from services.stack.servers import start_nats_server
from services.stack.waiting import wait_until
from shared.bus import Bus, WorkerRegistry
from shared.disagg import RemotePrefills
from shared.disagg.prefill_queue import PrefillQueues
from shared.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from shared.protocol import GenerateRequest, Subjects, WorkerInfo
from shared.protocol import SamplingParams as WireSamplingParams

PROMPT = [(7 * i + 3) % 256 for i in range(100)]  # 6 full 16-token blocks: long enough to go remote


def other_prompt(k: int) -> list[int]:
    """A prompt sharing no block with PROMPT or another ``other_prompt`` (no prefix-cache hit)."""
    return [(7 * i + 100 + k) % 256 for i in range(100)]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "engine"))
    from tiny_hf_models import save_tiny

    from shared.model.loader import load_model

    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny("llama", path)
    return load_model(path, "hf", torch.device("cpu"), torch.float32)


@pytest.fixture
async def engine(tiny_model):
    engine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(kv_cache_memory=2 << 20), model_id="tiny"))
    yield engine
    engine.shutdown()  # from this thread, so that it gets its intra-op threads back


class NoNotifications:
    """The KV transfer's surface the decode worker polls: no prefill worker ever writes here."""

    class stats:
        num_bytes_received = 0
        num_bytes_sent = 0

    def get_notifications(self):
        return []


@pytest.fixture
async def pollers():
    """The decode workers' notification pollers (which also end the waits), stopped at the end."""
    tasks: list[asyncio.Task] = []
    yield tasks
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def decode_worker(bus: Bus, namespace: str, engine: AsyncEngine, pollers: list[asyncio.Task], *,
                        max_prefill_queue: int = 128, window_s: float = 120.0) -> DecodeWorker:
    """A decode worker with remote prefill on, beside a registered (but absent) prefill worker,
    its poller running as in ``run()``. The window (``remote_prefill_timeout_s``) outlasts
    ``generate``'s deadline: a failure path must give the reservation up at once, not wait it out."""
    settings = DecodeSettings(namespace=namespace, worker_id="decode-t", max_local_prefill_tokens=32,
                              max_prefill_queue=max_prefill_queue, remote_prefill_timeout_s=window_s,
                              kv_write_timeout_s=1.0)
    subjects = Subjects(namespace)
    registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=60, watch=True)  # as in run()
    await registry.put(WorkerInfo(worker_id="prefill-t", role="prefill", state="ready", model=settings.model,
                                  block_size=16, max_model_len=512, generate_subject="g"))
    prefills = RemotePrefills(worker_id=settings.worker_id, model=settings.model, engine=engine,
                              config=settings.disagg_config(), timeout_s=settings.remote_prefill_timeout_s,
                              write_timeout_s=settings.kv_write_timeout_s)
    remote = RemotePrefiller(prefills, bus=bus, registry=registry, transfer=NoNotifications(), subjects=subjects)
    worker = DecodeWorker(settings, bus, registry, engine, remote)
    worker.state = "ready"
    pollers.append(asyncio.create_task(remote.poll_forever()))
    pollers.append(asyncio.create_task(every(0.2, remote.check_prefill_workers, "prefill worker check")))
    await wait_until(remote._has_prefill_workers, timeout_s=10, what="the prefill worker in the registry copy")
    return worker


async def prefill_queue(bus: Bus, namespace: str, *, max_msgs: int = 100) -> PrefillQueues:
    """The prefill queue as prefill workers create it: a work-queue stream and a pull consumer per
    priority level."""
    s = Subjects(namespace)
    await bus.ensure_stream(s.prefill_stream, [s.prefill_queue_all().subject], max_age_s=60, max_msgs=max_msgs,
                            work_queue=True)
    return await PrefillQueues.open(bus, s, ack_wait_s=30, max_deliver=1, max_skips=3)


async def generate(worker: DecodeWorker, request_id: str) -> list[int]:
    request = GenerateRequest(request_id=request_id, model=worker._settings.model, prompt_token_ids=PROMPT,
                              sampling=WireSamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))

    async def tokens() -> list[int]:
        return [t for chunk in [c async for c in worker.generate(request)] for t in chunk.token_ids]

    try:
        return await asyncio.wait_for(tokens(), timeout=30)
    except asyncio.TimeoutError:
        raise AssertionError(f"{request_id}: no tokens within 30s (waiting out the remote-prefill window?)") from None


async def local_tokens(engine: AsyncEngine) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [t for out in [o async for o in engine.generate("reference", PROMPT, params)] for t in out.new_token_ids]


def counts(worker: DecodeWorker) -> tuple[int, int, int]:
    load = worker.load()
    return load.num_local_prefills, load.num_prefill_fallbacks, load.num_remote_prefills


async def num_queued(bus: Bus, namespace: str) -> int:
    s = Subjects(namespace)
    return (await bus.stream_state(s.prefill_stream)).num_msgs


async def test_a_healthy_queue_gets_the_request_and_the_window_ends_in_a_local_prefill(bus, namespace, engine, pollers):
    """The control case: the same setup publishes. Nobody takes the message, so the wait ends with
    the window and the request prefills locally (the blocks go back to the pool afterwards)."""
    worker = await decode_worker(bus, namespace, engine, pollers, window_s=3.0)
    queue = await prefill_queue(bus, namespace)
    assert await generate(worker, "r1") == await local_tokens(engine)
    [msg] = await queue.fetch(1)
    assert (msg.payload.request_id, msg.payload.prompt_token_ids) == ("r1", PROMPT)
    assert counts(worker) == (0, 1, 0)

    async def released():
        return engine.stats().num_blocks_used == 0

    await wait_until(released, timeout_s=10, what="the reserved blocks back in the pool after the window")


async def test_a_full_queue_refuses_the_publish_and_the_request_prefills_locally(bus, namespace, engine, pollers,
                                                                               caplog):
    """The stream holds max_msgs already: JetStream refuses the message (discard new), the decode
    worker gives its reservation up at once."""
    worker = await decode_worker(bus, namespace, engine, pollers)
    await prefill_queue(bus, namespace, max_msgs=2)
    for k in (1, 2):
        await generate_published(worker, f"queued-{k}", other_prompt(k))
    assert await num_queued(bus, namespace) == 2
    before = counts(worker)
    worker.remote.prefills.observe_queue(0.0, None)  # read the queue afresh: it holds 2 (< max_prefill_queue)
    with caplog.at_level("WARNING", logger="shared.disagg.remote_prefill"):
        assert await generate(worker, "r1") == await local_tokens(engine)
    assert "prefill queue publish failed" in caplog.text and "maximum messages exceeded" in caplog.text
    assert counts(worker) == (before[0], before[1] + 1, 0)
    assert await num_queued(bus, namespace) == 2


async def test_the_worker_says_which_requests_it_runs(bus, namespace, engine, pollers):
    """``status`` with a request id: true while the request waits for its remote prefill, false for
    an id it never got and once the request ended (what a gateway asks when a first token is late)."""
    from shared.protocol import ControlRequest

    worker = await decode_worker(bus, namespace, engine, pollers, window_s=3.0)
    await prefill_queue(bus, namespace)

    async def holds(request_id):
        return (await worker.control(ControlRequest(action="status", request_id=request_id))).holds_request

    running = asyncio.create_task(generate(worker, "r1"))
    await wait_until(lambda: num_queued(bus, namespace), timeout_s=10, what="r1 on the prefill queue")
    assert await holds("r1") is True and await holds("never-sent") is False
    assert (await worker.control(ControlRequest(action="status"))).holds_request is None
    assert await running == await local_tokens(engine)  # the window ends: prefilled here
    assert await holds("r1") is False


async def test_the_last_prefill_worker_gone_ends_the_waits_nobody_leased(bus, namespace, engine, pollers):
    """The request is on the queue, nobody has taken it, and the only prefill worker leaves the
    registry: it prefills here within seconds, not at the end of its 120 s window; a prefill
    worker that takes the message afterwards is refused a lease."""
    from shared.protocol import PrefillLeaseRequest

    worker = await decode_worker(bus, namespace, engine, pollers)  # window 120 s
    queue = await prefill_queue(bus, namespace)
    running = asyncio.create_task(generate(worker, "r1"))
    await wait_until(lambda: num_queued(bus, namespace), timeout_s=10, what="r1 on the prefill queue")
    assert not running.done()
    await worker._registry.delete("prefill-t")
    assert await running == await local_tokens(engine)  # generate() fails after 30 s
    assert counts(worker) == (0, 1, 0)
    [msg] = await queue.fetch(1)
    lease = await worker.remote.grant_lease(PrefillLeaseRequest(
        request_id="r1", transfer_id=msg.payload.transfer_id, prefill_worker_id="late"))
    assert lease.expires_at is None


async def generate_published(worker: DecodeWorker, request_id: str, prompt: list[int]) -> None:
    """Reserve and publish one request, then let its wait end: it stays in the queue."""
    request = GenerateRequest(request_id=request_id, model=worker._settings.model, prompt_token_ids=prompt)
    prefill = await worker.remote.start(request, SamplingParams(max_tokens=1))
    assert prefill is not None and not prefill.future.done(), "the publish should have succeeded"
    worker.remote.cancel(request_id)
    async for _ in worker.remote.outputs(prefill):
        pass


async def test_a_queue_at_the_policys_limit_keeps_the_prompt_local(bus, namespace, engine, pollers):
    """The queue length read from JetStream reaches the policy: at max_prefill_queue, nothing is
    reserved or published."""
    worker = await decode_worker(bus, namespace, engine, pollers, max_prefill_queue=1)
    await prefill_queue(bus, namespace)
    await generate_published(worker, "queued-1", other_prompt(1))
    worker.remote.prefills.observe_queue(0.0, None)  # read the queue afresh
    assert await generate(worker, "r1") == await local_tokens(engine)
    assert counts(worker)[0] == 1 and await num_queued(bus, namespace) == 1


async def test_a_refused_publish_means_a_local_prefill(bus, namespace, engine, pollers, caplog):
    """The queue is there and readable, but the server refuses the message (larger than the
    stream's max_msg_size)."""
    from nats.js.api import RetentionPolicy, StreamConfig

    s = Subjects(namespace)
    await bus.js.add_stream(StreamConfig(name=s.prefill_stream, subjects=[s.prefill_queue_all().subject],
                                         retention=RetentionPolicy.WORK_QUEUE, max_msg_size=64))
    await PrefillQueues.open(bus, s, ack_wait_s=30, max_deliver=1, max_skips=3)
    worker = await decode_worker(bus, namespace, engine, pollers)
    with caplog.at_level("WARNING", logger="shared.disagg.remote_prefill"):
        assert await generate(worker, "r1") == await local_tokens(engine)
    assert "prefill queue publish failed" in caplog.text
    assert counts(worker) == (0, 1, 0) and await num_queued(bus, namespace) == 0


@pytest.mark.parametrize("what", ["consumer", "stream"])
async def test_a_deleted_queue_means_a_local_prefill(bus, namespace, engine, pollers, what):
    worker = await decode_worker(bus, namespace, engine, pollers)
    await prefill_queue(bus, namespace)
    s = Subjects(namespace)
    if what == "consumer":
        await bus.js.delete_consumer(s.prefill_stream, s.prefill_consumer())
    else:
        await bus.js.delete_stream(s.prefill_stream)
    assert await generate(worker, "r1") == await local_tokens(engine)
    assert counts(worker) == (1, 0, 0)


async def test_an_unreachable_nats_means_a_local_prefill(namespace, engine, pollers, tmp_path, caplog):
    """The server goes away after the worker connected: the queue state cannot be read."""
    server = start_nats_server(tmp_path)
    bus = await Bus.connect(server.url, "decode-t")
    try:
        worker = await decode_worker(bus, namespace, engine, pollers)
        await prefill_queue(bus, namespace)
        server.stop()
        await wait_until(lambda: _disconnected(bus), timeout_s=10, what="the client to notice the server is gone")
        with caplog.at_level("WARNING", logger="services.decode.remote"):
            assert await generate(worker, "r1") == await local_tokens(engine)
        assert "prefill queue state unavailable" in caplog.text
        assert counts(worker) == (1, 0, 0)
    finally:
        server.stop()
        with contextlib.suppress(ConnectionError):  # closing flushes into the lost connection
            await bus.nc.close()


async def _disconnected(bus: Bus) -> bool:
    return not bus.nc.is_connected
