"""``/v1/files`` and ``/v1/batches`` (OpenAI's Files and Batch APIs), answered by any gateway from
what NATS holds (``shared.openai_api.batch``), and the batch work every gateway does beside its HTTP site: the
sweep that moves batches along (``BatchCoordinator``) and the line runner (``batch_runner``).

Each file and batch names its owner, the API key's owner id (``ApiKeys.owner``; a batch's result
files are its owner's): with keys configured, another key's file or batch is a 404 everywhere
(retrieve, content, delete, cancel, a batch's ``input_file_id``) and lists hold the caller's own.
Without keys every object is every caller's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import BodyPartReader, web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.framework.lifecycle import every
from services.gateway.batch_runner import BatchRunner, History, RunnerConfig
from services.gateway.core import GatewayCore
from shared.openai_api.auth import owns
from shared.openai_api.batch.coordinator import BatchCoordinator, CoordinatorConfig
from shared.openai_api.batch.objects import batch_object, file_object, new_file_id
from shared.openai_api.batch.store import BatchStore, FileStore
from shared.openai_api.errors import ApiError, from_validation_error
from shared.openai_api.responses import page
from shared.protocol import Subjects
from shared.protocol.batch import FileRecord

log = logging.getLogger(__name__)

PURPOSES = ("batch",)
_CHUNK_BYTES = 1 << 16
_MAX_LIST = 10_000


class CreateBatchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)


class Batches:
    """The Files and Batch APIs of one gateway, and its share of the batch work."""

    def __init__(self, gateway: GatewayCore, files: FileStore, batches: BatchStore,
                 history: History | None = None) -> None:
        self._gateway, self._settings = gateway, gateway.settings
        self.files = files
        self.coordinator = BatchCoordinator(batches, files, CoordinatorConfig(
            max_line_bytes=self._settings.batch_max_line_bytes))
        self.runner = BatchRunner(gateway, batches, RunnerConfig(
            max_in_flight=self._settings.batch_max_in_flight, ack_wait_s=self._settings.batch_ack_wait_s,
            max_deliver=self._settings.batch_max_deliver,
            in_flight_beside_online=self._settings.batch_in_flight_beside_online,
            online_quiet_s=self._settings.batch_online_quiet_s), history)
        self._steps: set[asyncio.Task] = set()

    @classmethod
    async def open(cls, gateway: GatewayCore, history: History | None = None) -> "Batches":
        """``history``: the stored responses ``/v1/responses`` lines continue (None: none kept)."""
        subjects = Subjects(gateway.settings.namespace)
        return cls(gateway, await FileStore.open(gateway.bus, subjects), await BatchStore.open(gateway.bus, subjects),
                   history)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload_file)
        app.router.add_get("/v1/files", self.list_files)
        app.router.add_get("/v1/files/{file_id}", self.get_file)
        app.router.add_get("/v1/files/{file_id}/content", self.file_content)
        app.router.add_delete("/v1/files/{file_id}", self.delete_file)
        app.router.add_post("/v1/batches", self.create_batch)
        app.router.add_get("/v1/batches", self.list_batches)
        app.router.add_get("/v1/batches/{batch_id}", self.get_batch)
        app.router.add_post("/v1/batches/{batch_id}/cancel", self.cancel_batch)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The sweep and (unless ``batch_max_in_flight`` is 0) the runner, for the block."""
        work = [asyncio.create_task(every(self._settings.batch_sweep_interval_s, self.coordinator.sweep,
                                          "batch sweep"))]
        if self._settings.batch_max_in_flight:
            work.append(asyncio.create_task(self.runner.run_forever()))
        try:
            yield
        finally:
            for task in [*work, *self._steps]:
                task.cancel()
            await asyncio.gather(*work, *self._steps, return_exceptions=True)

    def _authorize(self, request: web.Request) -> str | None:
        """The caller's owner id (``ApiKeys.owner``); a 401 for a bad key. Files and batches of
        another owner are answered as if they did not exist (404), and lists hold the caller's own."""
        return self._gateway.api_keys.owner(request.headers.get("Authorization"))

    # --- files -----------------------------------------------------------------------------------
    async def upload_file(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        limit = self._settings.max_file_bytes
        if request.content_length is not None and request.content_length > limit + _CHUNK_BYTES:
            raise _too_large(limit)  # refused before reading a byte
        try:
            reader = await request.multipart()
        except (AssertionError, ValueError, KeyError):
            raise ApiError(400, "expected a multipart/form-data body with fields file and purpose") from None
        purpose, filename, data = None, None, None
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                filename = part.filename or "upload.jsonl"
                data = await _read_limited(part, limit)
        if data is None:
            raise ApiError(400, "missing the file field", param="file", code="missing_parameter")
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}", param="purpose",
                           code="invalid_value")
        record = FileRecord(id=new_file_id(), bytes=len(data), created_at=int(time.time()), filename=filename,
                            purpose=purpose, owner=owner)
        await self.files.put(record, data)
        return web.json_response(file_object(record))

    async def list_files(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        records = [r for r in await self.files.list() if owns(owner, r.owner)]
        if purpose := request.query.get("purpose"):
            records = [r for r in records if r.purpose == purpose]
        if request.query.get("order", "desc") == "asc":
            records.reverse()
        return web.json_response(page([file_object(r) for r in records], limit=list_limit(request, _MAX_LIST),
                                      after=request.query.get("after")))

    async def get_file(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        return web.json_response(file_object(await self._file(request.match_info["file_id"], owner)))

    async def file_content(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        file_id = (await self._file(request.match_info["file_id"], owner)).id
        data = await self.files.content(file_id)
        if data is None:
            raise _no_file(file_id)
        return web.Response(body=data, content_type="application/octet-stream")

    async def delete_file(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        file_id = (await self._file(request.match_info["file_id"], owner)).id
        if not await self.files.delete(file_id):
            raise _no_file(file_id)
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    async def _file(self, file_id: str, owner: str | None) -> FileRecord:
        if (record := await self.files.get(file_id)) is None or not owns(owner, record.owner):
            raise _no_file(file_id)
        return record

    # --- batches ---------------------------------------------------------------------------------
    async def create_batch(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        try:
            body = CreateBatchBody.model_validate_json(await request.read())
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        record = await self.coordinator.create(body.input_file_id, body.endpoint, body.completion_window,
                                               body.metadata, owner)
        step = asyncio.create_task(self.coordinator.advance(record.id))  # validate now, not at the next sweep
        self._steps.add(step)
        step.add_done_callback(self._steps.discard)
        return web.json_response(batch_object(record))

    async def get_batch(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        return web.json_response(batch_object(await self.coordinator.view(request.match_info["batch_id"], owner)))

    async def list_batches(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        records = await self.coordinator.list(owner)
        return web.json_response(page([batch_object(r) for r in records], limit=list_limit(request, 100),
                                      after=request.query.get("after")))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        return web.json_response(batch_object(await self.coordinator.cancel(request.match_info["batch_id"], owner)))


async def _read_limited(part: BodyPartReader, limit: int) -> bytes:
    """The part's bytes; a 413 as soon as they pass ``limit`` (what is left is not stored)."""
    chunks, size = [], 0
    while chunk := await part.read_chunk(_CHUNK_BYTES):
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the file is larger than this server's limit of {limit} bytes (max_file_bytes)",
                    param="file", code="file_too_large")


def _no_file(file_id: str) -> ApiError:
    return ApiError(404, f"No such file: {file_id}", param="file_id", code="file_not_found")


def list_limit(request: web.Request, maximum: int) -> int:
    try:
        limit = int(request.query.get("limit", 20 if maximum == 100 else maximum))
    except ValueError:
        raise ApiError(400, "limit must be an integer", param="limit", code="invalid_value") from None
    if not 1 <= limit <= maximum:
        raise ApiError(400, f"limit must be between 1 and {maximum}", param="limit", code="invalid_value")
    return limit
