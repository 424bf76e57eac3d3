"""Where files and batches live in NATS (names from ``Subjects``):

- files: Object Store ``files_bucket``, one object per file id, its ``FileRecord`` as the
  object's description (bytes and record are written in one put, so neither exists alone);
- batches: KV ``batches_bucket``, batch id → ``BatchRecord``, changed by compare-and-set only;
- lines: work-queue stream ``batch_stream``, one subject per batch, pulled by the batch runners;
- results: KV ``batch_results_bucket``, one key per (batch id, custom_id), written once
  (``KvBucket.create``), plus a marker per failed line so that counts need no values.

All of it is JetStream file storage: a batch outlives every process, and any gateway can answer
for it."""

from __future__ import annotations

import asyncio

from shared.bus import Bus, KvBucket, ObjectBucket, WorkQueue
from shared.bus.kv import Versioned
from shared.openai_api.batch.lines import InputLine
from shared.protocol.batch import BatchLineRequest, BatchLineResult, BatchRecord, FileRecord
from shared.protocol.subjects import Subjects

_LINES_MAX_AGE_S = 8 * 24 * 3600.0   # longer than any completion window
_LINES_MAX_MSGS = 5_000_000
_PUBLISH_CONCURRENCY = 64

class FileStore:
    def __init__(self, objects: ObjectBucket) -> None:
        self._objects = objects

    @classmethod
    async def open(cls, bus: Bus, subjects: Subjects) -> "FileStore":
        return cls(await bus.object_store(subjects.files_bucket))

    async def put(self, record: FileRecord, data: bytes) -> FileRecord:
        await self._objects.put(record.id, data, record.model_dump_json())
        return record

    async def get(self, file_id: str) -> FileRecord | None:
        stored = await self._objects.info(file_id)
        return None if stored is None else FileRecord.model_validate_json(stored.description)

    async def content(self, file_id: str) -> bytes | None:
        return await self._objects.get(file_id)

    async def list(self) -> list[FileRecord]:
        """Every file, newest first."""
        records = [FileRecord.model_validate_json(o.description) for o in await self._objects.list() if o.description]
        return sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)

    async def delete(self, file_id: str) -> bool:
        return await self._objects.delete(file_id)


class BatchStore:
    def __init__(self, bus: Bus, subjects: Subjects, records: KvBucket, results: KvBucket) -> None:
        self._bus, self._subjects = bus, subjects
        self._records, self._results = records, results

    @classmethod
    async def open(cls, bus: Bus, subjects: Subjects) -> "BatchStore":
        await bus.ensure_stream(subjects.batch_stream, [subjects.batch_lines_all().subject],
                                max_age_s=_LINES_MAX_AGE_S, max_msgs=_LINES_MAX_MSGS, work_queue=True)
        return cls(bus, subjects, await bus.key_value(subjects.batches_bucket),
                   await bus.key_value(subjects.batch_results_bucket))

    # --- records ---------------------------------------------------------------------------------
    async def create(self, record: BatchRecord) -> None:
        if not await self._records.create(record.id, record.to_bytes()):
            raise RuntimeError(f"batch id {record.id} already exists")

    async def get(self, batch_id: str) -> Versioned | None:
        if (entry := await self._records.entry(batch_id)) is None:
            return None
        return Versioned(BatchRecord.from_bytes(entry[0]), entry[1])

    async def replace(self, current: Versioned, record: BatchRecord) -> Versioned | None:
        """Compare and set: the new version, or None if the record changed since ``current``."""
        if not await self._records.update(record.id, record.to_bytes(), current.revision):
            return None
        return await self.get(record.id)

    async def list(self) -> list[BatchRecord]:
        """Every batch, newest first."""
        records = [BatchRecord.from_bytes(value) for _, value in await self._records.items()]
        return sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)

    # --- lines -----------------------------------------------------------------------------------
    async def enqueue(self, batch_id: str, lines: list[InputLine]) -> None:
        """Every line as a work item (a repeat after a crash queues duplicates: the runner skips a
        line that already has a result, and the result store keeps the first one anyway)."""
        endpoint = self._subjects.batch_lines(batch_id)
        gate = asyncio.Semaphore(_PUBLISH_CONCURRENCY)

        async def publish(line: InputLine) -> None:
            async with gate:
                await self._bus.js_publish(endpoint, BatchLineRequest(
                    batch_id=batch_id, line=line.line, custom_id=line.custom_id, url=line.url, body=line.body))

        await asyncio.gather(*(publish(line) for line in lines))

    async def purge_lines(self, batch_id: str) -> None:
        """Drop the batch's lines not yet done (cancel, expiry)."""
        await self._bus.purge_subject(self._subjects.batch_stream, self._subjects.batch_lines(batch_id).subject)

    async def line_consumer(self, *, ack_wait_s: float, max_deliver: int, max_ack_pending: int) -> WorkQueue:
        return await self._bus.pull_consumer(self._subjects.batch_lines_all(), self._subjects.batch_stream,
                                             self._subjects.batch_consumer, ack_wait_s=ack_wait_s,
                                             max_deliver=max_deliver, max_ack_pending=max_ack_pending)

    # --- results ---------------------------------------------------------------------------------
    async def store_result(self, result: BatchLineResult) -> bool:
        """Keep the line's result unless it has one: True if this call stored it. The failure
        marker follows the result; if the process dies between the two, the counts shown while
        the batch runs miss it, and finalization (which reads the results) does not."""
        stored = await self._results.create(Subjects.batch_result_key(result.batch_id, result.custom_id),
                                            result.to_bytes())
        if not result.is_ok:  # also on a repeat: the marker of a result stored before a crash
            await self._results.create(Subjects.batch_failure_key(result.batch_id, result.custom_id), b"1")
        return stored

    async def has_result(self, batch_id: str, custom_id: str) -> bool:
        return await self._results.get(Subjects.batch_result_key(batch_id, custom_id)) is not None

    async def count_results(self, batch_id: str) -> tuple[int, int]:
        """(lines with a result, lines whose result is a failure), without reading the results."""
        done, failed = await asyncio.gather(self._results.count(Subjects.batch_results_prefix(batch_id)),
                                            self._results.count(Subjects.batch_failures_prefix(batch_id)))
        return done, failed

    async def results(self, batch_id: str) -> list[BatchLineResult]:
        items = await self._results.items_under(Subjects.batch_results_prefix(batch_id))
        return [BatchLineResult.from_bytes(value) for _, value in items]
