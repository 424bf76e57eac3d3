"""The bus against a real nats-server: replies, the error wrapper, streams, JetStream, registry."""

import asyncio

import pytest

from shared.bus import Bus, BusTimeout, NoResponders, RemoteError, ServiceError, WorkerRegistry
from shared.protocol import (AdmissionDecision, BlockStoredEvent, GenerateRequest, KvEventBatch,
                             Subjects, TokenChunk, WorkerInfo)
from services.stack.waiting import wait_until

REQ = GenerateRequest(request_id="r1", model="m", prompt_token_ids=[1, 2, 3])


async def test_request_reply_and_error_wrapper_keeps_serving(bus, namespace):
    endpoint = Subjects(namespace).admission_submit()

    async def handle(req: GenerateRequest) -> AdmissionDecision:
        if req.request_id == "boom":
            raise KeyError("bug")
        if req.request_id == "reject":
            raise ServiceError("rejected", "draining")
        return AdmissionDecision(request_id=req.request_id, is_admitted=True, worker_id="w")

    await bus.serve(endpoint, handle)
    reply = await bus.request(endpoint, REQ, timeout_s=2)
    assert reply.worker_id == "w"

    # A malformed message: an error reply naming the problem, and the service keeps serving.
    msg = await bus.nc.request(endpoint.subject, b'{"request_id": 5}', timeout=2)
    assert msg.headers["Tandem-Error-Code"] == "bad_request"
    assert b"request_id" in msg.data
    with pytest.raises(RemoteError) as info:
        await bus.request(endpoint, REQ.model_copy(update={"request_id": "boom"}), timeout_s=2)
    assert info.value.code == "internal"
    with pytest.raises(RemoteError) as info:
        await bus.request(endpoint, REQ.model_copy(update={"request_id": "reject"}), timeout_s=2)
    assert (info.value.code, info.value.message) == ("rejected", "draining")
    assert (await bus.request(endpoint, REQ, timeout_s=2)).is_admitted
    assert bus.num_handler_errors == 1


async def test_no_responders_and_timeout(bus, namespace):
    subjects = Subjects(namespace)
    with pytest.raises(NoResponders):
        await bus.request(subjects.admission_submit(), REQ, timeout_s=2)

    async def slow(req):
        await asyncio.sleep(5)

    await bus.serve(subjects.kvindex_match(), slow)
    from shared.protocol import KvMatchRequest
    with pytest.raises(BusTimeout):
        await bus.request(subjects.kvindex_match(), KvMatchRequest(block_hashes=[1]), timeout_s=0.2)


async def test_stop_serving_waits_for_handlers_and_names_those_it_cuts_off(bus, namespace, caplog):
    subjects = Subjects(namespace)
    release = asyncio.Event()

    async def held(req):
        await release.wait()
        return AdmissionDecision(request_id=req.request_id, is_admitted=True, worker_id="w")

    await bus.serve(subjects.admission_submit(), held)
    release.set()  # the first request is answered and leaves nothing in flight
    assert (await bus.request(subjects.admission_submit(), REQ, timeout_s=2)).is_admitted
    release.clear()
    waiting = asyncio.create_task(bus.request(subjects.admission_submit(), REQ, timeout_s=2))

    async def one_in_flight() -> bool:
        return bus.num_in_flight == 1

    await wait_until(one_in_flight, timeout_s=5, what="the held request in flight")
    with caplog.at_level("WARNING", logger="shared.bus.bus"):
        assert await bus.stop_serving(timeout_s=0.2) == 1
    assert f"1 handlers still running after 0.2s, cancelled: {subjects.admission_submit().subject}" in caplog.text
    with pytest.raises(BusTimeout):  # cut off: no reply comes
        await waiting
    release.set()


async def test_streamed_replies_end_and_errors(bus, namespace):
    endpoint = Subjects(namespace).decode_generate("w1")

    async def generate(req: GenerateRequest):
        for i in range(3):
            yield TokenChunk(request_id=req.request_id, index=i, token_ids=[i],
                             finish_reason="length" if i == 2 else None)
        if req.request_id == "fail":
            raise ServiceError("rejected", "late failure")

    await bus.serve_stream(endpoint, generate)
    chunks = [c async for c in bus.stream(endpoint, REQ, first_timeout_s=2, idle_timeout_s=2)]
    assert [c.token_ids for c in chunks] == [[0], [1], [2]]
    with pytest.raises(RemoteError, match="late failure"):
        async for _ in bus.stream(endpoint, REQ.model_copy(update={"request_id": "fail"}),
                                  first_timeout_s=2, idle_timeout_s=2):
            pass
    with pytest.raises(NoResponders):
        async for _ in bus.stream(Subjects(namespace).decode_generate("nobody"), REQ,
                                  first_timeout_s=2, idle_timeout_s=2):
            pass


async def test_jetstream_replay_from_start_and_from_seq(bus, namespace):
    subjects = Subjects(namespace)
    await bus.ensure_stream(subjects.kv_events_stream, [subjects.kv_events_all().subject],
                            max_age_s=60, max_msgs=1000)
    await bus.ensure_stream(subjects.kv_events_stream, [subjects.kv_events_all().subject],
                            max_age_s=60, max_msgs=1000)  # idempotent
    info = await bus.js.stream_info(subjects.kv_events_stream)
    assert (info.config.max_age, info.config.max_msgs) == (60, 1000)
    for seq in (1, 2, 3):
        batch = KvEventBatch(worker_id="w1", events=[
            BlockStoredEvent(seq=seq, timestamp=0.0, block_hashes=[seq])])
        await bus.js_publish(subjects.kv_events("w1"), batch)
    await bus.nc.publish(subjects.kv_events("w1").subject, b"garbage")

    seen: list[tuple[int, int]] = []
    done = asyncio.Event()

    async def on_batch(batch: KvEventBatch, stream_seq: int) -> None:
        seen.append((batch.events[0].seq, stream_seq))
        if len(seen) == 3:
            done.set()

    await bus.replay(subjects.kv_events_all(), subjects.kv_events_stream, on_batch)
    await asyncio.wait_for(done.wait(), 5)
    assert [s for s, _ in seen] == [1, 2, 3]

    later: list[int] = []
    got = asyncio.Event()

    async def on_later(batch: KvEventBatch, stream_seq: int) -> None:
        later.append(batch.events[0].seq)
        got.set()

    other = await Bus.connect(bus.nc.connected_url.geturl(), "replayer")
    try:
        await other.replay(subjects.kv_events_all(), subjects.kv_events_stream, on_later,
                           start_seq=seen[-1][1])
        await asyncio.wait_for(got.wait(), 5)
        assert later == [3]
    finally:
        await other.close()


async def test_registry_entries_expire_without_heartbeat(bus, namespace):
    subjects = Subjects(namespace)
    registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=1.0)
    info = WorkerInfo(worker_id="w1", role="decode", model="m", block_size=16, max_model_len=64,
                      generate_subject="g", cancel_subject="c")
    beating = asyncio.create_task(registry.heartbeat(lambda: info.model_copy(
        update={"worker_id": "w2"})))
    await registry.put(info)
    assert {w.worker_id for w in await wait_until(registry.list, timeout_s=5)} >= {"w1"}

    async def only_w2():
        return [w.worker_id for w in await registry.list()] == ["w2"]

    await wait_until(only_w2, timeout_s=6, what="w1 to expire")
    beating.cancel()
    await asyncio.gather(beating, return_exceptions=True)
    await registry.delete("w2")
    assert [w.worker_id for w in await registry.list()] == []


async def test_watched_registry_follows_puts_deletes_and_expiry(bus, namespace):
    bucket = Subjects(namespace).workers_bucket
    writer = await WorkerRegistry.open(bus, bucket, ttl_s=1.0)
    info = WorkerInfo(worker_id="w1", role="decode", model="m", block_size=16, max_model_len=64,
                      generate_subject="g", cancel_subject="c")
    await writer.put(info)
    watched = await WorkerRegistry.open(bus, bucket, watch=True)
    assert [w.worker_id for w in await watched.list()] == ["w1"]  # entries present at start
    await writer.put(info.model_copy(update={"worker_id": "w2", "state": "draining"}))

    async def ids():
        return sorted(w.worker_id for w in await watched.list())

    async def both():
        return await ids() == ["w1", "w2"]

    await wait_until(both, timeout_s=5, what="w2 in the watched copy")
    await writer.delete("w2")

    async def only_w1_or_none():
        return await ids() in (["w1"], [])

    await wait_until(only_w1_or_none, timeout_s=5, what="w2's delete in the watched copy")

    async def expired():
        return await ids() == []

    await wait_until(expired, timeout_s=5, what="w1 to expire from the watched copy")  # no heartbeat


async def heartbeating_w1(bus, bucket: str, ttl_s: float):
    """A registry bucket with worker w1 heartbeating into it, and a watched copy that lists it:
    (writer, w1's info, the heartbeat task, the watched copy)."""
    writer = await WorkerRegistry.open(bus, bucket, ttl_s=ttl_s)
    info = WorkerInfo(worker_id="w1", role="decode", model="m", block_size=16, max_model_len=64,
                      generate_subject="g", cancel_subject="c")
    beating = asyncio.create_task(writer.heartbeat(lambda: info))
    watched = await WorkerRegistry.open(bus, bucket, watch=True)
    assert [w.worker_id for w in await watched.list()] == ["w1"]
    return writer, info, beating, watched


async def test_a_watch_whose_consumer_dies_while_connected_is_started_over_before_entries_age_out(bus, namespace):
    """The consumer behind a watch is kept by one server; when that server dies and the client's
    does not, the client stays connected and the watch goes silent. Deleting the consumer does the
    same here. A worker heartbeating all along must never leave the watched copy, and a worker
    registered afterwards must enter it."""
    bucket = Subjects(namespace).workers_bucket
    ttl_s = 3.0
    writer, info, beating, watched = await heartbeating_w1(bus, bucket, ttl_s)
    try:
        consumers = await bus.js.consumers_info(f"KV_{bucket}")
        assert len(consumers) == 1  # the watch's
        await bus.js.delete_consumer(f"KV_{bucket}", consumers[0].name)
        loop = asyncio.get_running_loop()
        end = loop.time() + 4 * ttl_s  # nats-py alone would start the consumer over after 10 s
        while loop.time() < end:
            assert "w1" in [w.worker_id for w in await watched.list()], "a live worker left the copy"
            await asyncio.sleep(0.05)
        assert watched.num_watch_restarts >= 1
        await writer.put(info.model_copy(update={"worker_id": "w2"}))

        async def w2_seen():
            return "w2" in [w.worker_id for w in await watched.list()]

        await wait_until(w2_seen, timeout_s=5, what="w2 in the watched copy")
    finally:
        beating.cancel()


async def test_a_registry_that_cannot_be_read_keeps_its_workers_until_it_can(bus, namespace):
    """The bucket without a leader (a NATS member lost; here: its stream deleted): the watch cannot
    be started over and heartbeats fail, yet the copy keeps its live worker for many TTLs instead
    of dropping every worker at once. Once the bucket is back, entries age out as before."""
    bucket = Subjects(namespace).workers_bucket
    ttl_s = 2.0
    _, _, beating, watched = await heartbeating_w1(bus, bucket, ttl_s)
    try:
        await bus.js.delete_stream(f"KV_{bucket}")
        loop = asyncio.get_running_loop()
        end = loop.time() + 5 * ttl_s
        while loop.time() < end:
            assert [w.worker_id for w in await watched.list()] == ["w1"], "the worker left an unreadable copy"
            await asyncio.sleep(0.1)
        assert watched._num_failed_restarts >= 1
        await bus.key_value(bucket, ttl_s=ttl_s)  # the bucket back (a new leader): heartbeats land again

        async def restarted():
            return not watched._stale and watched._num_failed_restarts == 0

        await wait_until(restarted, timeout_s=10, what="the watch started over on the bucket")
        assert [w.worker_id for w in await watched.list()] == ["w1"]
    finally:
        beating.cancel()

    async def expired():
        return await watched.list() == []

    await wait_until(expired, timeout_s=4 * ttl_s, what="w1 to age out once heartbeats stop")


async def test_connecting_to_an_unreachable_server_fails_by_its_deadline():
    """nats-py alone would retry forever: the caller gets a ConnectionError naming the URL."""
    from services.stack.servers import free_port

    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConnectionError, match=f"cannot reach NATS at {url} within 1s"):
        await asyncio.wait_for(Bus.connect(url, "probe", timeout_s=1.0), timeout=60)


async def test_work_queue_messages_are_typed_and_settled_by_the_consumer(bus, namespace):
    from shared.bus import ConsumerState, StreamState
    from shared.protocol import RemotePrefillRequest

    s = Subjects(namespace)
    await bus.ensure_stream(s.prefill_stream, [s.prefill_queue().subject], max_age_s=60, max_msgs=100,
                            work_queue=True)
    queue = await bus.pull_consumer(s.prefill_queue(), s.prefill_stream, s.prefill_consumer(), ack_wait_s=30,
                                    max_deliver=3)
    assert await queue.fetch(1, timeout_s=0.2) == []  # nothing queued: an empty batch, no error

    def message(rid: str) -> RemotePrefillRequest:
        return RemotePrefillRequest(request_id=rid, transfer_id=rid * 4, model="m", prompt_token_ids=[1] * 40,
                                    decode_worker_id="d", block_ids=[1, 2, 3], block_size=16, num_cached_tokens=0,
                                    write_deadline=0.0, write_timeout_s=1.0, created_at=0.0)

    await bus.js_publish(s.prefill_queue(), message("a"))
    await bus.nc.publish(s.prefill_queue().subject, b"not a prefill request")
    await bus.js_publish(s.prefill_queue(), message("b"))
    await bus.nc.flush()
    assert await bus.consumer_info(s.prefill_stream, s.prefill_consumer()) == ConsumerState(
        num_pending=3, num_ack_pending=0, num_redelivered=0, num_waiting=0)
    first = await queue.fetch(3, timeout_s=2)  # the malformed one is terminated, not handed out
    assert [(m.payload.request_id, m.num_delivered, m.stream_seq) for m in first] == [("a", 1, 1), ("b", 1, 3)]
    await first[0].ack()
    await first[1].nak()  # back in the queue at once
    [again] = await queue.fetch(3, timeout_s=2)
    assert (again.payload.request_id, again.num_delivered) == ("b", 2)
    await again.in_progress()
    await again.term()
    assert await queue.fetch(3, timeout_s=0.2) == []

    async def settled():
        info = await bus.consumer_info(s.prefill_stream, s.prefill_consumer())
        return info.num_pending == info.num_ack_pending == 0 or None

    await wait_until(settled, timeout_s=5, what="every message acked or terminated")
    assert await bus.stream_state(s.prefill_stream) == StreamState(num_msgs=0, first_seq=4, last_seq=3)
    await queue.close()
    assert await bus.consumer_info(s.prefill_stream, "nobody") is None
    assert await bus.stream_state(f"{namespace}-no-such-stream") is None


async def test_kv_bucket_reads_missing_and_deleted_keys_as_none(bus, namespace):
    bucket = await bus.key_value(f"{namespace}-kv", ttl_s=60)
    assert await bucket.keys() == [] and await bucket.get("w1") is None
    await bucket.put("w1", b"one")
    await bucket.put("w2", b"two")
    assert (await bucket.get("w1"), sorted(await bucket.keys())) == (b"one", ["w1", "w2"])
    await bucket.delete("w1")
    await bucket.delete("w1")  # idempotent
    assert await bucket.get("w1") is None and await bucket.keys() == ["w2"]
    assert await bucket.ttl_s() == 60
    same = await bus.key_value(f"{namespace}-kv", ttl_s=5)  # binds to the existing bucket and its TTL
    assert (await same.get("w2"), await same.ttl_s()) == (b"two", 60)


async def test_a_registry_read_right_after_a_put_lists_the_entry(bus, namespace):
    """Without a live copy the registry lists the bucket; nats-py's own key listing could end before
    a just-written key arrived (seen about once in 3,000 tries), so a worker that had just
    registered was missing."""
    for b in range(30):  # small buckets: a listing reads every key
        registry = await WorkerRegistry.open(bus, f"{namespace}-reg{b}", ttl_s=30.0)
        for i in range(10):
            info = WorkerInfo(worker_id=f"w{i}", role="decode", model="m", block_size=16, max_model_len=64,
                              generate_subject="g", cancel_subject="c")
            await registry.put(info)
            assert f"w{i}" in {w.worker_id for w in await registry.list()}, f"bucket {b}: put {i} not listed"
