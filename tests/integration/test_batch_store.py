"""The batch stores and coordinator on a real nats-server (no model): files in the Object Store,
a batch's life through the sweep's steps, results written once, the result files, cancel with
partial results kept, a malformed file failing validation with its line named, a step whose
gateway died taken over, and a batch and its files seen only by their owner."""

from __future__ import annotations

import json

import pytest

from shared.openai_api.batch.coordinator import BatchCoordinator, CoordinatorConfig
from shared.openai_api.batch.store import BatchStore, FileStore
from shared.openai_api.errors import ApiError
from shared.protocol import Subjects
from shared.protocol.batch import BatchLineResult, FileRecord

CHAT = "/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def parts(bus, namespace):
    subjects = Subjects(namespace)
    files, batches = await FileStore.open(bus, subjects), await BatchStore.open(bus, subjects)
    clock = Clock()
    return files, batches, BatchCoordinator(batches, files, CoordinatorConfig(claim_stale_s=60), clock), clock


def input_file(n: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT,
                                "body": {"messages": [{"role": "user", "content": str(i)}]}}).encode() + b"\n"
                    for i in range(n))


async def upload(files: FileStore, data: bytes, file_id: str = "file-in") -> str:
    await files.put(FileRecord(id=file_id, bytes=len(data), created_at=1, filename="in.jsonl", purpose="batch"), data)
    return file_id


def ok(batch_id: str, line: int) -> BatchLineResult:
    return BatchLineResult(batch_id=batch_id, line=line, custom_id=f"c{line - 1}", request_id=f"r{line}",
                           status_code=200, body=json.dumps({"n": line}))


async def pull_all(batches: BatchStore) -> list:
    queue = await batches.line_consumer(ack_wait_s=30, max_deliver=5, max_ack_pending=100)
    got = []
    while messages := await queue.fetch(100, timeout_s=0.5):
        got.extend(messages)
    await queue.close()
    return got


async def test_files_round_trip_list_and_delete(parts):
    files, *_ = parts
    data = bytes(range(256)) * 3000  # several object-store chunks
    await upload(files, data, "file-a")
    await upload(files, b"x", "file-b")
    assert await files.content("file-a") == data
    assert (await files.get("file-a")).bytes == len(data)
    assert {r.id for r in await files.list()} == {"file-a", "file-b"}
    assert await files.delete("file-a") and not await files.delete("file-a")
    assert await files.get("file-a") is None and await files.content("file-a") is None
    assert [r.id for r in await files.list()] == ["file-b"]


async def test_a_batch_runs_to_completion_with_each_result_once(parts):
    files, batches, coordinator, clock = parts
    file_id = await upload(files, input_file(3))
    record = await coordinator.create(file_id, CHAT, "24h", {"job": "test"})
    assert record.status == "validating"
    assert (await coordinator.advance(record.id)).kind == "validate"
    running = await coordinator.view(record.id)
    assert (running.status, running.request_counts.total) == ("in_progress", 3)
    lines = await pull_all(batches)
    assert sorted(m.payload.custom_id for m in lines) == ["c0", "c1", "c2"]

    assert await batches.store_result(ok(record.id, 1))
    assert not await batches.store_result(ok(record.id, 1).model_copy(update={"request_id": "again"}))
    failed = BatchLineResult(batch_id=record.id, line=2, custom_id="c1", status_code=400,
                             body=json.dumps({"error": {"message": "bad"}}))
    assert await batches.store_result(failed)
    assert await coordinator.advance(record.id) is None  # one line still running
    counts = (await coordinator.view(record.id)).request_counts
    assert (counts.total, counts.completed, counts.failed) == (3, 1, 1)

    assert await batches.store_result(ok(record.id, 3))
    assert (await coordinator.advance(record.id)).kind == "finalize"
    done = await coordinator.view(record.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 2, 1)
    output = [json.loads(l) for l in (await files.content(done.output_file_id)).splitlines()]
    errors = [json.loads(l) for l in (await files.content(done.error_file_id)).splitlines()]
    assert [(o["custom_id"], o["response"]["request_id"]) for o in output] == [("c0", "r1"), ("c2", "r3")]
    assert [e["custom_id"] for e in errors] == ["c1"]
    assert (await files.get(done.output_file_id)).purpose == "batch_output"


async def test_malformed_file_fails_validation_naming_the_line(parts):
    files, batches, coordinator, _ = parts
    file_id = await upload(files, input_file(2) + b"{oops\n")
    record = await coordinator.create(file_id, CHAT, "24h", None)
    await coordinator.advance(record.id)
    failed = await coordinator.view(record.id)
    assert failed.status == "failed" and failed.failed_at is not None
    assert [(e.code, e.line) for e in failed.errors] == [("invalid_json_line", 3)]
    assert await pull_all(batches) == []


async def test_create_refuses_unknown_files_endpoints_and_windows(parts):
    files, _, coordinator, _ = parts
    file_id = await upload(files, input_file(1))
    for args, status, param in [(("file-nope", CHAT, "24h"), 404, "input_file_id"),
                                ((file_id, "/v1/embeddings", "24h"), 400, "endpoint"),
                                ((file_id, CHAT, "1h"), 400, "completion_window")]:
        with pytest.raises(ApiError) as err:
            await coordinator.create(*args, None)
        assert (err.value.status, err.value.param) == (status, param)


async def test_cancel_purges_queued_lines_and_keeps_partial_results(parts):
    files, batches, coordinator, clock = parts
    record = await coordinator.create(await upload(files, input_file(4)), CHAT, "24h", None)
    await coordinator.advance(record.id)
    await batches.store_result(ok(record.id, 1))
    cancelling = await coordinator.cancel(record.id)
    assert cancelling.status == "cancelling"
    assert (await coordinator.cancel(record.id)).status == "cancelling"  # idempotent
    assert await pull_all(batches) == []
    assert await coordinator.advance(record.id) is None  # running lines get the grace period
    clock.now += 5
    assert (await coordinator.advance(record.id)).kind == "finish_cancel"
    cancelled = await coordinator.view(record.id)
    assert (cancelled.status, cancelled.request_counts.completed) == ("cancelled", 1)
    assert [json.loads(l)["custom_id"] for l in (await files.content(cancelled.output_file_id)).splitlines()] == ["c0"]
    with pytest.raises(ApiError) as err:
        await coordinator.cancel(record.id + "x")
    assert err.value.status == 404


async def test_expired_batch_reports_unrun_lines_and_stale_claims_are_taken_over(parts):
    files, batches, coordinator, clock = parts
    record = await coordinator.create(await upload(files, input_file(3)), CHAT, "24h", None)
    # a gateway claimed validation and died: nobody else touches it until the claim is stale
    current = await batches.get(record.id)
    await batches.replace(current, current.record.model_copy(update={"claimed_at": clock.now}))
    assert await coordinator.advance(record.id) is None
    clock.now += 61
    assert (await coordinator.advance(record.id)).kind == "validate"
    await batches.store_result(ok(record.id, 2))
    clock.now += 86400
    assert (await coordinator.advance(record.id)).kind == "expire"
    expired = await coordinator.view(record.id)
    assert (expired.status, expired.request_counts.completed, expired.request_counts.failed) == ("expired", 1, 2)
    errors = [json.loads(l) for l in (await files.content(expired.error_file_id)).splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("c0", "batch_expired"), ("c2", "batch_expired")]
    assert await pull_all(batches) == []


async def test_a_batch_and_its_files_belong_to_its_owner(parts):
    """Another owner's batch or input file is a 404, as if it did not exist; the result files get
    the batch's owner; no owner (no API keys) sees everything."""
    files, batches, coordinator, _ = parts
    await files.put(FileRecord(id="file-mine", bytes=1, created_at=1, filename="in.jsonl", purpose="batch",
                               owner="key_a"), input_file(1))
    with pytest.raises(ApiError) as err:
        await coordinator.create("file-mine", CHAT, "24h", None, owner="key_b")
    assert (err.value.status, err.value.param) == (404, "input_file_id")
    record = await coordinator.create("file-mine", CHAT, "24h", None, owner="key_a")
    assert record.owner == "key_a"
    for call in (lambda: coordinator.view(record.id, "key_b"), lambda: coordinator.cancel(record.id, "key_b")):
        with pytest.raises(ApiError) as err:
            await call()
        assert (err.value.status, err.value.code) == (404, "batch_not_found")
    assert [r.id for r in await coordinator.list("key_b")] == []
    assert [r.id for r in await coordinator.list("key_a")] == [r.id for r in await coordinator.list()] == [record.id]
    await coordinator.advance(record.id)
    assert await batches.store_result(ok(record.id, 1))
    await coordinator.advance(record.id)
    done = await coordinator.view(record.id, "key_a")
    assert done.status == "completed" and (await files.get(done.output_file_id)).owner == "key_a"
    with pytest.raises(ApiError):
        await coordinator.cancel(record.id, "key_a")  # its own: found, but completed (400, not 404)
