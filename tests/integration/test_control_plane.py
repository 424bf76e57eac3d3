"""kv-index, admission and autoscaler in-process against real NATS and Redis, with test code
playing the decode workers (registering, publishing KV events and load)."""

import asyncio
import time

import pytest

from services.admission.config import AdmissionSettings
from services.admission.service import AdmissionService
from shared.policy.admission import Inflow
from services.autoscaler.config import AutoscalerSettings
from services.autoscaler.service import AutoscalerService
from services.kv_index.config import KvIndexSettings
from services.kv_index.service import KvIndexService
from shared.bus import WorkerRegistry
from shared.protocol import (BlockStoredEvent, ClusterStatusRequest, GenerateRequest, KvEventBatch,
                             KvMatchRequest, Subjects, WorkerInfo, WorkerLoad)
from services.stack.waiting import wait_until
from shared.store import KvIndexStore, RedisKeys, connect


def worker(subjects, worker_id):
    return WorkerInfo(worker_id=worker_id, role="decode", model="m", block_size=4, max_model_len=256,
                      generate_subject=subjects.decode_generate(worker_id).subject,
                      cancel_subject=subjects.decode_cancel(worker_id).subject)


@pytest.fixture
async def heartbeats():
    """The heartbeat task of each worker ``plane`` registers, by id: a test stops one to let its
    worker leave."""
    tasks: dict[str, asyncio.Task] = {}
    yield tasks
    for task in tasks.values():
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def plane(bus, nats_url, redis_url, namespace, heartbeats):
    """The services over a 1 s registry TTL, with decode workers w1 and w2 heartbeating as real
    ones do (every TTL/3): listed however slow the machine is."""
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
        info = worker(subjects, w)
        await registry.put(info)  # listed before the services start
        heartbeats[w] = asyncio.create_task(registry.heartbeat(lambda info=info: info))
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


async def test_worker_that_leaves_is_swept_and_avoided(bus, plane, heartbeats):
    subjects, registry, store, kv_index, admission = plane
    await bus.js_publish(subjects.kv_events("w1"), KvEventBatch(worker_id="w1", events=[
        BlockStoredEvent(seq=1, timestamp=time.time(), block_hashes=[21, 22])]))
    await wait_until(lambda: store.owners(21), timeout_s=5, what="w1's blocks in the index")
    decision = await bus.request(subjects.admission_submit(), request("r1", [21, 22]), timeout_s=2)
    assert decision.worker_id == "w1"

    await stop(heartbeats.pop("w1"))
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


async def one_worker_admission(bus, nats_url, subjects, qos, **settings) -> AdmissionService:
    """Admission with tiers from ``qos`` and one registered decode worker, ``w1``, whose load
    reports the test publishes itself."""
    registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=5.0)
    await registry.put(worker(subjects, "w1"))
    admission = AdmissionService(AdmissionSettings(nats_url=nats_url, namespace=subjects.namespace,
                                                   kv_match_timeout_s=0.1, qos=str(qos), retry_after_s=0.1,
                                                   **settings),
                                 bus, registry)
    await admission.start()
    return admission


async def test_a_lower_tier_is_rejected_when_the_higher_tier_arriving_meanwhile_would_take_the_prefill(
        bus, nats_url, namespace, tmp_path):
    qos = tmp_path / "qos.yaml"
    qos.write_text("default_tier: batch\ntiers:\n  premium: {priority: 0, ttft_slo_ms: 60000}\n"
                   "  batch: {priority: 2, ttft_slo_ms: 1000}\n")
    subjects = Subjects(namespace)
    # the mean arrivals alone (the margin over their spread is checked in the slot test below)
    admission = await one_worker_admission(bus, nats_url, subjects, qos, arrival_margin_sd=0.0)
    admission.inflow = Inflow(window_s=10.0, min_span_s=10.0)  # the arrivals' rate over 10 s from the start

    async def report(seq: int) -> None:
        await bus.publish(subjects.load("decode", "w1"), WorkerLoad(
            worker_id="w1", role="decode", seq=seq, timestamp=time.time(), prefill_tokens_per_s=100.0))
        await wait_until(lambda: _reported(admission, seq), timeout_s=5, what=f"load report {seq} at admission")

    def submit(request_id: str, tier: str, num_tokens: int):
        req = request(request_id, [], num_tokens).model_copy(update={"tier": tier})
        return bus.request(subjects.admission_submit(), req, timeout_s=2)

    await report(1)
    assert (await submit("b1", "batch", 50)).is_admitted        # 50 tokens at 100 tok/s: 0.5 s
    for i in range(10):                                           # 640 premium tokens in the 10 s window
        assert (await submit(f"p{i}", "premium", 64)).is_admitted
    await report(2)   # the worker has prefilled them all: nothing is queued ahead of a new request
    # Alone the batch request would take 0.5 s again, but premium prompts keep arriving at 64 tok/s
    # and go first: 50 / (100 - 64) = 1.39 s, over the batch tier's 1 s.
    decision = await submit("b2", "batch", 50)
    assert (decision.is_admitted, decision.reject_reason) == (False, "slo"), decision
    assert "predicted TTFT 1.39s > batch SLO 1.00s" in decision.message
    assert decision.retry_after_s == pytest.approx(0.39, abs=0.01)
    assert (await submit("p10", "premium", 50)).is_admitted     # nothing arrives above premium: 0.5 s


async def _reported(admission, seq: int) -> bool:
    entry = admission.view.get("w1")
    return entry is not None and entry.load is not None and entry.load.seq == seq


async def test_a_full_batch_frees_slots_at_the_pace_of_the_output_lengths_of_finished_requests(
        bus, nats_url, namespace, tmp_path):
    qos = tmp_path / "qos.yaml"
    qos.write_text("default_tier: batch\ntiers:\n  batch: {priority: 2, ttft_slo_ms: 1000}\n")
    subjects = Subjects(namespace)
    admission = await one_worker_admission(bus, nats_url, subjects, qos)

    async def report(seq: int, output_tokens_recent: float | None, itl_batch: float | None = None) -> None:
        # 16 of 16 slots busy, 4 waiting, a 100 ms step; 100 requests started, 1000 tokens so far
        # (many still decoding: 10 per started request, while finished ones had 40)
        await bus.publish(subjects.load("decode", "w1"), WorkerLoad(
            worker_id="w1", role="decode", seq=seq, timestamp=time.time(), prefill_tokens_per_s=1e6,
            num_running=16, max_num_seqs=16, num_running_by_priority={2: 16}, num_waiting=4,
            num_waiting_by_priority={2: 4}, itl_recent_s=0.1, itl_recent_batch=itl_batch, num_requests_total=100,
            num_generated_tokens_total=1000, output_tokens_recent=output_tokens_recent))
        await wait_until(lambda: _reported(admission, seq), timeout_s=5, what=f"load report {seq} at admission")

    # slots free at 16 / (40 tokens x 0.1 s) = 4 per second: 4 ahead + itself = 1.25 s, over 1 s
    await report(1, 40.0)
    decision = await bus.request(subjects.admission_submit(), request("b1", [], 16), timeout_s=2)
    assert (decision.is_admitted, decision.reject_reason) == (False, "slo"), decision
    assert "predicted TTFT 1.25s" in decision.message
    # nothing finished recently: the started requests' mean (10 tokens) is all there is, 0.31 s
    await report(2, None)
    decision = await bus.request(subjects.admission_submit(), request("b2", [], 16), timeout_s=2)
    assert decision.is_admitted and decision.predicted_ttft_s == pytest.approx(0.3125, abs=0.01), decision
    # b2 was admitted with max_tokens 16: until a request finishes, the answers may be that long
    # (they are at least what was generated so far): 16 / (16 x 0.1 s) = 10 per second, 0.5 s
    await report(3, None)
    decision = await bus.request(subjects.admission_submit(), request("b3", [], 16), timeout_s=2)
    assert decision.is_admitted and decision.predicted_ttft_s == pytest.approx(0.5, abs=0.01), decision
    # the 100 ms ITL was measured on 4 sequences, the batch now runs 16: 0.4 s with all of them,
    # slots free at 16 / (40 x 0.4 s) = 1 per second: 5 s
    await report(4, 40.0, itl_batch=4.0)
    decision = await bus.request(subjects.admission_submit(), request("b4", [], 16), timeout_s=2)
    assert (decision.is_admitted, decision.reject_reason) == (False, "slo"), decision
    assert "predicted TTFT 5.00s" in decision.message
    await report(5, 40.0, itl_batch=16.0)        # measured on the full batch: 1.25 s as before
    decision = await bus.request(subjects.admission_submit(), request("b5", [], 16), timeout_s=2)
    assert "predicted TTFT 1.25s" in decision.message


async def test_short_premium_answers_take_a_one_slot_worker_only_briefly_from_a_waiting_batch_request(
        bus, nats_url, namespace, tmp_path):
    qos = tmp_path / "qos.yaml"
    qos.write_text("default_tier: batch\ntiers:\n  premium: {priority: 0, ttft_slo_ms: 60000}\n"
                   "  batch: {priority: 2, ttft_slo_ms: 30000}\n")
    subjects = Subjects(namespace)
    admission = await one_worker_admission(bus, nats_url, subjects, qos)
    admission.inflow = Inflow(window_s=10.0, min_span_s=10.0)  # the arrivals' rate over 10 s from the start

    async def report(seq: int, by_priority: dict[int, float]) -> None:
        # one slot, taken by a batch request; recent answers 200 tokens on average at 25 ms a token
        await bus.publish(subjects.load("decode", "w1"), WorkerLoad(
            worker_id="w1", role="decode", seq=seq, timestamp=time.time(), prefill_tokens_per_s=1e6,
            num_running=1, max_num_seqs=1, num_running_by_priority={2: 1}, itl_recent_s=0.025,
            num_requests_total=10, num_generated_tokens_total=2000, output_tokens_recent=200.0,
            output_tokens_recent_by_priority=by_priority))
        await wait_until(lambda: _reported(admission, seq), timeout_s=5, what=f"load report {seq} at admission")

    def submit(request_id: str, tier: str):
        req = request(request_id, [], 16).model_copy(update={"tier": tier})
        return bus.request(subjects.admission_submit(), req, timeout_s=2)

    await report(1, {})
    for i in range(3):                      # premium at 0.3 requests/s over the 10 s window
        assert (await submit(f"p{i}", "premium")).is_admitted
    # A worker that does not say how long each tier's answers are: each premium arrival counts as
    # holding the slot for the mean answer (5 s), 0.3/s against a slot freeing every 5 s: never.
    await report(2, {})
    decision = await submit("b1", "batch")
    assert (decision.is_admitted, decision.reject_reason) == (False, "slo"), decision
    assert "predicted TTFT inf" in decision.message
    # Premium answers are 8 tokens: premium keeps the slot busy 0.3 x 8 x 25 ms = 6% of the time,
    # and the other 94% turns over every 5 s: 5.32 s at the mean arrivals. With 1.645 standard
    # deviations of the premium count over the wait W (the default margin), each premium arrival
    # costing 8/200 of a turnover, and the rate a count over the 10 s watched:
    # W x 0.94/5 = 1 + 1.645 x 0.04 x sqrt(0.3 W + 0.3 W^2 / 10), W = 5.91 s.
    await report(3, {0: 8.0, 2: 200.0})
    decision = await submit("b2", "batch")
    wait = decision.predicted_ttft_s
    assert decision.is_admitted and wait is not None and wait > 5 / 0.94, decision
    assert wait * 0.94 / 5 == pytest.approx(1 + 1.645 * 0.04 * (0.3 * wait + 0.3 * wait ** 2 / 10) ** 0.5,
                                            abs=0.005), decision
