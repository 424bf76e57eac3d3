"""kv-index, admission and autoscaler in-process against real NATS and Redis, with test code
playing the decode workers (registering, publishing KV events and load)."""

import time

import pytest

from services.admission.config import AdmissionSettings
from services.admission.service import AdmissionService
from services.autoscaler.config import AutoscalerSettings
from services.autoscaler.service import AutoscalerService
from services.kv_index.config import KvIndexSettings
from services.kv_index.service import KvIndexService
from shared.bus import WorkerRegistry
from shared.protocol import (BlockStoredEvent, ClusterStatusRequest, GenerateRequest, KvEventBatch,
                             KvMatchRequest, Subjects, WorkerInfo, WorkerLoad)
from shared.runtime.waiting import wait_until
from shared.store import KvIndexStore, RedisKeys, connect


def worker(subjects, worker_id):
    return WorkerInfo(worker_id=worker_id, role="decode", model="m", block_size=4, max_model_len=256,
                      generate_subject=subjects.decode_generate(worker_id).subject,
                      cancel_subject=subjects.decode_cancel(worker_id).subject)


@pytest.fixture
async def plane(bus, nats_url, redis_url, namespace):
    common = dict(nats_url=nats_url, namespace=namespace, registry_ttl_s=1.0)
    subjects = Subjects(namespace)
    registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=1.0)
    redis = connect(redis_url)
    store = KvIndexStore(redis, RedisKeys(namespace))
    kv_index = KvIndexService(KvIndexSettings(redis_url=redis_url, **common), bus, store, registry)
    admission = AdmissionService(AdmissionSettings(max_waiting_per_worker=2, **common), bus, registry)
    autoscaler = AutoscalerService(AutoscalerSettings(**common), bus, registry)
    await kv_index.start()
    for w in ("w1", "w2"):
        await registry.put(worker(subjects, w))
    await admission.start()
    await autoscaler.start()
    yield subjects, registry, store, kv_index, admission
    await redis.aclose()


def request(request_id, hashes, num_tokens=16):
    return GenerateRequest(request_id=request_id, model="m", prompt_token_ids=list(range(num_tokens)),
                           block_hashes=hashes)


async def test_routes_to_prefix_owner_and_survives_index_rebuild(bus, plane, redis_url, namespace):
    subjects, registry, store, kv_index, _ = plane
    await bus.js_publish(subjects.kv_events("w2"), KvEventBatch(worker_id="w2", events=[
        BlockStoredEvent(seq=1, timestamp=time.time(), block_hashes=[11, 12, 13])]))
    match = subjects.kvindex_match()

    async def indexed():
        return (await bus.request(match, KvMatchRequest(block_hashes=[11, 12, 13, 14]), timeout_s=2)).overlaps

    overlaps = await wait_until(indexed, timeout_s=5, what="w2's blocks in the index")
    assert [(o.worker_id, o.num_blocks) for o in overlaps] == [("w2", 3)]
    decision = await bus.request(subjects.admission_submit(), request("r1", [11, 12, 13, 14]), timeout_s=2)
    assert (decision.is_admitted, decision.worker_id, decision.num_overlap_blocks) == (True, "w2", 3)
    assert decision.generate_subject == subjects.decode_generate("w2").subject
    assert await store.owners(12) == {"w2"}

    # A restarted index with an empty Redis replays the stream and answers the same.
    for w in await store.workers():
        await store.drop_worker(w)
    await store._r.delete(RedisKeys(namespace).stream_seq())
    again = KvIndexService(kv_index._settings, bus, store, registry)
    await again.start()
    await wait_until(lambda: store.owners(12), timeout_s=5, what="replayed ownership")


async def test_worker_that_leaves_is_swept_and_avoided(bus, plane):
    subjects, registry, store, kv_index, admission = plane
    await bus.js_publish(subjects.kv_events("w1"), KvEventBatch(worker_id="w1", events=[
        BlockStoredEvent(seq=1, timestamp=time.time(), block_hashes=[21, 22])]))
    await wait_until(lambda: store.owners(21), timeout_s=5, what="w1's blocks in the index")
    decision = await bus.request(subjects.admission_submit(), request("r1", [21, 22]), timeout_s=2)
    assert decision.worker_id == "w1"

    await registry.delete("w1")  # as if its TTL ran out

    async def swept():
        return "w1" in await kv_index.sweep()

    await wait_until(swept, timeout_s=5, what="w1 swept")
    assert await store.owners(21) == set()
    await admission.refresh()
    decision = await bus.request(subjects.admission_submit(), request("r2", [21, 22]), timeout_s=2)
    assert decision.worker_id == "w2"


async def test_rejections_and_status(bus, plane):
    subjects, registry, store, kv_index, admission = plane
    for i, w in enumerate(("w1", "w2")):
        await bus.publish(subjects.load("decode", w), WorkerLoad(
            worker_id=w, role="decode", seq=1, timestamp=time.time(), num_waiting=2, num_running=3))

    async def both_loaded():
        status = await bus.request(subjects.cluster_status(), ClusterStatusRequest(), timeout_s=2)
        return all(ws.load is not None for ws in status.workers) and status

    status = await wait_until(both_loaded, timeout_s=5, what="loads in the cluster view")
    assert [ws.info.worker_id for ws in status.workers] == ["w1", "w2"]

    async def loaded_at_admission():
        return all(e.load for e in admission.view.ready_workers("decode"))

    await wait_until(loaded_at_admission, timeout_s=5, what="loads at admission")
    decision = await bus.request(subjects.admission_submit(), request("r1", []), timeout_s=2)
    assert (decision.is_admitted, decision.reject_reason) == (False, "overloaded")
    assert decision.retry_after_s > 0
    other_model = request("r2", []).model_copy(update={"model": "unknown"})
    decision = await bus.request(subjects.admission_submit(), other_model, timeout_s=2)
    assert (decision.is_admitted, decision.reject_reason) == (False, "unavailable")


@pytest.mark.parametrize("payload", [b"", b"{", b'{"block_hashes": ["x"]}', b"\xff\xfe"])
async def test_malformed_messages_get_error_replies_and_services_keep_running(bus, plane, payload):
    subjects = plane[0]
    for endpoint in (subjects.admission_submit(), subjects.kvindex_match(), subjects.cluster_status()):
        if endpoint.request_type is ClusterStatusRequest and payload.startswith(b'{"'):
            continue  # an empty request model accepts any object
        msg = await bus.nc.request(endpoint.subject, payload, timeout=2)
        assert msg.headers["Tandem-Error-Code"] == "bad_request", (endpoint.subject, msg.data)
    await bus.request(subjects.kvindex_match(), KvMatchRequest(block_hashes=[1]), timeout_s=2)


async def test_without_kv_index_admission_routes_to_the_least_loaded(bus, nats_url, namespace):
    subjects = Subjects(namespace)
    registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=5.0)
    for w in ("w1", "w2"):
        await registry.put(worker(subjects, w))
    admission = AdmissionService(AdmissionSettings(nats_url=nats_url, namespace=namespace,
                                                   kv_match_timeout_s=0.1), bus, registry)
    await admission.start()
    await bus.publish(subjects.load("decode", "w1"), WorkerLoad(
        worker_id="w1", role="decode", seq=1, timestamp=time.time(), num_blocks_used=50))

    async def loaded():
        return admission.view.get("w1").load is not None

    await wait_until(loaded, timeout_s=5, what="w1's load at admission")
    decision = await bus.request(subjects.admission_submit(), request("r1", [1, 2, 3, 4]), timeout_s=2)
    assert (decision.is_admitted, decision.worker_id, decision.num_overlap_blocks) == (True, "w2", 0)
