"""The batch lifecycle against the stores: create, view (with live counts), cancel, and the
sweep that takes each batch's next step (``shared.openai_api.batch.state.next_step``). Every gateway sweeps;
a step is claimed by compare-and-set first, so it runs in one gateway at a time, and each step is
idempotent (lines enqueued twice are run once; the result files have fixed ids), so a gateway that
dies mid-step leaves it to the next claim."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.bus.kv import Versioned
from shared.openai_api.auth import owns
from shared.openai_api.batch import state
from shared.openai_api.batch.lines import parse_input
from shared.openai_api.batch.objects import new_batch_id, result_file_ids
from shared.openai_api.batch.output import BatchFiles, assemble
from shared.openai_api.batch.store import BatchStore, FileStore
from shared.openai_api.errors import ApiError
from shared.protocol.batch import BatchEndpoint, BatchLineError, BatchRecord, FileRecord, RequestCounts

log = logging.getLogger(__name__)

ENDPOINTS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass(frozen=True)
class CoordinatorConfig:
    max_line_bytes: int = 1 << 20      # a line is one work-queue message: below NATS's max payload
    claim_stale_s: float = 120.0       # a step claimed this long ago, unfinished: its gateway died
    cancel_grace_s: float = 2.0        # lines running at a cancel may still finish in this time


class BatchCoordinator:
    def __init__(self, batches: BatchStore, files: FileStore, config: CoordinatorConfig = CoordinatorConfig(),
                 clock: Callable[[], float] = time.time) -> None:
        self.batches, self.files, self.config, self._clock = batches, files, config, clock

    # --- API ------------------------------------------------------------------------------------
    # ``owner``: the caller's owner id (``ApiKeys.owner``; None: no keys, every batch and file is
    # the caller's). A batch or input file of another owner is a 404, as if it did not exist.
    async def create(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None, owner: str | None = None) -> BatchRecord:
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}",
                           param="endpoint", code="invalid_value")
        if completion_window not in state.WINDOWS_S:
            raise ApiError(400, f"completion_window must be one of {sorted(state.WINDOWS_S)}, got "
                           f"{completion_window!r}", param="completion_window", code="invalid_value")
        file = await self.files.get(input_file_id)
        if file is None or not owns(owner, file.owner):
            raise ApiError(404, f"No such file: {input_file_id}", param="input_file_id", code="file_not_found")
        if file.purpose != "batch":
            raise ApiError(400, f"file {input_file_id} has purpose {file.purpose!r}, not 'batch'",
                           param="input_file_id", code="invalid_value")
        now = int(self._clock())
        endpoint_: BatchEndpoint = endpoint  # type: ignore[assignment] — checked above
        record = BatchRecord(id=new_batch_id(), endpoint=endpoint_, input_file_id=input_file_id,
                             completion_window=completion_window, created_at=now,
                             expires_at=now + state.WINDOWS_S[completion_window], metadata=metadata,
                             owner=owner)
        await self.batches.create(record)
        return record

    async def view(self, batch_id: str, owner: str | None = None) -> BatchRecord:
        """The batch with its counts as of now (a running batch's come from the result store)."""
        current = await self._get(batch_id, owner)
        record = current.record
        if record.status in ("in_progress", "finalizing", "cancelling"):
            done, failed = await self.batches.count_results(batch_id)
            counts = RequestCounts(total=record.request_counts.total, completed=done - failed, failed=failed)
            record = record.model_copy(update={"request_counts": counts})
        return record

    async def list(self, owner: str | None = None) -> list[BatchRecord]:
        return [r for r in await self.batches.list() if owns(owner, r.owner)]

    async def cancel(self, batch_id: str, owner: str | None = None) -> BatchRecord:
        """Move the batch to cancelling and drop its queued lines at once (lines running now are
        stopped by the runners that hold them; results already stored are kept)."""
        while True:
            current = await self._get(batch_id, owner)
            if current.record.status in ("cancelling", "cancelled"):
                return current.record
            if not state.can_cancel(current.record):
                raise ApiError(400, f"batch {batch_id} is {current.record.status} and can no longer be cancelled",
                               code="invalid_state")
            if await self.batches.replace(current, state.transition(current.record, "cancelling", self._clock())):
                await self.batches.purge_lines(batch_id)
                return (await self._get(batch_id)).record

    async def _get(self, batch_id: str, owner: str | None = None) -> Versioned:
        if (current := await self.batches.get(batch_id)) is None or not owns(owner, current.record.owner):
            raise ApiError(404, f"No such batch: {batch_id}", param="batch_id", code="batch_not_found")
        return current

    # --- the sweep --------------------------------------------------------------------------------
    async def sweep(self) -> None:
        """Take the next step of every batch that needs one."""
        for record in await self.batches.list():
            if record.status not in state.TERMINAL:
                await self.advance(record.id)

    async def advance(self, batch_id: str) -> state.Step | None:
        """Claim and run the batch's next step; the step run, or None (nothing to do, or another
        gateway claimed it first)."""
        current = await self.batches.get(batch_id)
        if current is None:
            return None
        now = self._clock()
        done, _ = await self.batches.count_results(batch_id)
        step = state.next_step(current.record, done, now, claim_stale_s=self.config.claim_stale_s,
                               cancel_grace_s=self.config.cancel_grace_s)
        if step is None:
            return None
        claim = current.record.model_copy(update={"claimed_at": now})
        if step.kind == "finalize" and current.record.status == "in_progress":
            claim = state.transition(current.record, "finalizing", now).model_copy(update={"claimed_at": now})
        claimed = await self.batches.replace(current, claim)
        if claimed is None:
            return None
        log.info("batch %s: %s (%s)", batch_id, step.kind, step.reason)
        run = {"validate": self._validate, "finalize": self._finalize, "expire": self._expire,
               "finish_cancel": self._finish_cancel}[step.kind]
        await run(claimed)
        return step

    async def _validate(self, claimed: Versioned) -> None:
        record = claimed.record
        data = await self.files.content(record.input_file_id)
        if data is None:
            errors = [BatchLineError(code="file_not_found", param="input_file_id",
                                     message=f"input file {record.input_file_id} was deleted")]
            await self._close(claimed, state.transition(record, "failed", self._clock(), errors=errors))
            return
        lines, errors = parse_input(data, record.endpoint, max_line_bytes=self.config.max_line_bytes)
        if errors:
            await self._close(claimed, state.transition(record, "failed", self._clock(), errors=errors))
            return
        await self.batches.enqueue(record.id, lines)
        started = state.transition(record, "in_progress", self._clock(),
                                   request_counts=RequestCounts(total=len(lines)))
        if not await self._close(claimed, started):
            await self.batches.purge_lines(record.id)  # cancelled while the lines were queued

    async def _finalize(self, claimed: Versioned) -> None:
        record = claimed.record
        files = assemble(record.id, await self.batches.results(record.id), record.request_counts.total)
        await self._close(claimed, state.transition(record, "completed", self._clock(),
                                                    **await self._write_files(record, files)))

    async def _expire(self, claimed: Versioned) -> None:
        record = claimed.record
        await self.batches.purge_lines(record.id)
        results = await self.batches.results(record.id)
        done = {r.custom_id for r in results}
        data = await self.files.content(record.input_file_id) or b""
        lines, _ = parse_input(data, record.endpoint, max_line_bytes=self.config.max_line_bytes)
        missing = [(line.line, line.custom_id) for line in lines if line.custom_id not in done]
        files = assemble(record.id, results, record.request_counts.total, expired=missing)
        await self._close(claimed, state.transition(record, "expired", self._clock(),
                                                    **await self._write_files(record, files)))

    async def _finish_cancel(self, claimed: Versioned) -> None:
        record = claimed.record
        await self.batches.purge_lines(record.id)
        files = assemble(record.id, await self.batches.results(record.id), record.request_counts.total)
        await self._close(claimed, state.transition(record, "cancelled", self._clock(),
                                                    **await self._write_files(record, files)))

    async def _write_files(self, record: BatchRecord, files: BatchFiles) -> dict:
        """Store the non-empty files under the batch's fixed ids; the record's fields for them."""
        output_id, error_id = result_file_ids(record.id)
        fields: dict = {"request_counts": files.counts}
        now = int(self._clock())
        for file_id, data, field, kind in ((output_id, files.output, "output_file_id", "output"),
                                           (error_id, files.errors, "error_file_id", "errors")):
            if data:
                await self.files.put(FileRecord(id=file_id, bytes=len(data), created_at=now,
                                                filename=f"{record.id}_{kind}.jsonl", purpose="batch_output",
                                                owner=record.owner), data)
                fields[field] = file_id
        return fields

    async def _close(self, claimed: Versioned, record: BatchRecord) -> bool:
        """Write the step's outcome; False if the batch changed since the claim (cancelled meanwhile,
        or the claim went stale and another gateway took it over)."""
        if await self.batches.replace(claimed, record) is None:
            log.info("batch %s changed during its step; leaving it", record.id)
            return False
        log.info("batch %s: %s", record.id, record.status)
        return True
