"""The bus across a nats-server restart: the server is SIGKILLed and started again on the same port
with the same JetStream store (as ``tandem up`` does), and everything a service relies on works
again: core subscriptions, stream replays, the watched registry, durable work queues; a streamed
reply open across the restart ends with ``Disconnected`` instead of hanging. Also when the server
comes back without its store (streams, consumers and buckets are created again)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from shared.bus import Bus, Disconnected, WorkerRegistry
from shared.protocol import (AdmissionDecision, BlockStoredEvent, GenerateRequest, KvEventBatch,
                             RemotePrefillRequest, Subjects, TokenChunk, WorkerInfo)
from services.stack.servers import start_nats_server
from services.stack.waiting import wait_until

REQ = GenerateRequest(request_id="r1", model="m", prompt_token_ids=[1, 2, 3])
# The target is 5 s; the reconnect itself takes about a second. Without the bus's own resume,
# nats-py re-creates a lost ordered consumer only after two missed 5 s heartbeats: this catches that.
BACK_WITHIN_S = 8


@pytest.fixture
def own_nats(tmp_path):
    """A nats-server of this test only (the test kills it), with a password as ``tandem up`` sets."""
    server = start_nats_server(tmp_path / "nats", password="secret-for-this-test")
    yield server
    server.stop()


def batch(seq: int) -> KvEventBatch:
    return KvEventBatch(worker_id="w1", events=[BlockStoredEvent(seq=seq, timestamp=0.0, block_hashes=[seq])])


def prefill(rid: str) -> RemotePrefillRequest:
    return RemotePrefillRequest(request_id=rid, transfer_id=rid * 4, model="m", prompt_token_ids=[1] * 40,
                                decode_worker_id="d", block_ids=[1, 2, 3], block_size=16, num_cached_tokens=0,
                                write_deadline=0.0, write_timeout_s=1.0, created_at=0.0)


@pytest.mark.parametrize("keeps_store", [True, False], ids=["store-kept", "store-lost"])
async def test_everything_works_again_after_a_nats_server_restart(own_nats, namespace, tmp_path, keeps_store):
    s = Subjects(namespace)
    server_bus, client_bus = await Bus.connect(own_nats.url, "server"), await Bus.connect(own_nats.url, "client")
    try:
        # core request/reply and an endless streamed reply
        async def admit(req: GenerateRequest) -> AdmissionDecision:
            return AdmissionDecision(request_id=req.request_id, is_admitted=True, worker_id="w")

        async def generate(req: GenerateRequest):
            yield TokenChunk(request_id=req.request_id, index=0, token_ids=[7])
            await asyncio.Event().wait()  # the rest never comes: only the disconnect can end it

        await server_bus.serve(s.admission_submit(), admit)
        await server_bus.serve_stream(s.decode_generate("w1"), generate)
        # a stream replay, a watched registry, a durable work queue
        await server_bus.ensure_stream(s.kv_events_stream, [s.kv_events_all().subject], max_age_s=60, max_msgs=100)
        replayed: list[int] = []

        async def on_batch(b: KvEventBatch, stream_seq: int) -> None:
            replayed.append(b.events[0].seq)

        await server_bus.replay(s.kv_events_all(), s.kv_events_stream, on_batch)
        await client_bus.js_publish(s.kv_events("w1"), batch(1))
        await wait_until(lambda: replayed == [1], timeout_s=5, what="event 1 replayed")
        registry = await WorkerRegistry.open(server_bus, s.workers_bucket, ttl_s=30, watch=True)
        writer = await WorkerRegistry.open(client_bus, s.workers_bucket, ttl_s=30)
        await server_bus.ensure_stream(s.prefill_stream, [s.prefill_queue().subject], max_age_s=60,
                                       max_msgs=100, work_queue=True)
        queue = await server_bus.pull_consumer(s.prefill_queue(), s.prefill_stream, s.prefill_consumer(),
                                               ack_wait_s=30, max_deliver=3)

        stream = client_bus.stream(s.decode_generate("w1"), REQ, first_timeout_s=5, idle_timeout_s=600)
        assert (await anext(stream)).token_ids == [7]
        pending = asyncio.ensure_future(anext(stream))

        own_nats.proc.kill()
        own_nats.proc.wait()
        if not keeps_store:
            shutil.rmtree(tmp_path / "nats" / "jetstream")
        own_nats.restart()

        with pytest.raises(Disconnected):  # not a wait of idle_timeout_s for tokens lost meanwhile
            await asyncio.wait_for(pending, BACK_WITHIN_S)

        async def admitted():
            try:
                return (await client_bus.request(s.admission_submit(), REQ, timeout_s=1)).is_admitted
            except Exception:  # noqa: BLE001 — not reconnected yet
                return False

        await wait_until(admitted, timeout_s=BACK_WITHIN_S, what="request/reply after the restart")

        async def published(endpoint, payload):  # a lost stream is back once the server's bus resumed
            try:
                return await client_bus.js_publish(endpoint, payload, timeout_s=1)
            except Exception:  # noqa: BLE001
                return None

        await wait_until(lambda: published(s.kv_events("w1"), batch(2)), timeout_s=BACK_WITHIN_S,
                         what="publishing event 2")
        await wait_until(lambda: replayed == [1, 2], timeout_s=BACK_WITHIN_S,
                         what=f"event 2 replayed exactly once after the restart (got {replayed})")
        info = WorkerInfo(worker_id="w9", role="decode", model="m", block_size=16, max_model_len=64,
                          generate_subject="g", cancel_subject="c")

        async def put():
            try:
                await writer.put(info)
                return True
            except Exception:  # noqa: BLE001 — a lost bucket is back once the buses resumed
                return False

        await wait_until(put, timeout_s=BACK_WITHIN_S, what="a registry put")

        async def listed():
            return "w9" in {w.worker_id for w in await registry.list()}

        await wait_until(listed, timeout_s=BACK_WITHIN_S, what="a put after the restart in the watched copy")
        await wait_until(lambda: published(s.prefill_queue(), prefill("a")), timeout_s=BACK_WITHIN_S,
                         what="queueing a prefill")
        [msg] = await queue.fetch(1, timeout_s=BACK_WITHIN_S)
        assert msg.payload.request_id == "a"
        await msg.ack()
        assert replayed == [1, 2]
    finally:
        await client_bus.close()
        await server_bus.close()
