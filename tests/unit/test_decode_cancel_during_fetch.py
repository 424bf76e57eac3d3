"""A cancel that reaches a decode worker while the request waits for its prefix from a peer (before
the engine has it, so the engine's abort finds nothing): the request is not run once the fetch
ends, and its stream ends without a chunk."""

from __future__ import annotations

import asyncio

from services.decode.config import DecodeSettings
from services.decode.service import DecodeWorker
from shared.protocol import CancelRequest, GenerateRequest
from shared.protocol.prefill import KvSource


class SlowFetcher:
    def __init__(self) -> None:
        self.started, self.release = asyncio.Event(), asyncio.Event()

    async def fetch(self, request: GenerateRequest) -> int:
        self.started.set()
        await self.release.wait()
        return 0


class RecordingEngine:
    def __init__(self) -> None:
        self.generated: list[str] = []
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(self, request_id, prompt_token_ids, params, priority=0, *, deadline=None):
        self.generated.append(request_id)
        raise AssertionError("a cancelled request was run")
        yield  # an async generator, as the engine's


def worker(engine: RecordingEngine, fetcher: SlowFetcher) -> DecodeWorker:
    w = DecodeWorker(DecodeSettings(worker_id="d1", model="m"), None, None, engine, fetcher=fetcher)
    w.state = "ready"
    return w


def request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, model="m", prompt_token_ids=[1, 2, 3],
                           kv_source=KvSource(worker_id="d2", num_blocks=1))


async def test_a_request_cancelled_during_its_prefix_fetch_is_not_run():
    engine, fetcher = RecordingEngine(), SlowFetcher()
    w = worker(engine, fetcher)

    async def stream() -> list:
        return [chunk async for chunk in w.generate(request("r1"))]

    chunks = asyncio.create_task(stream())
    await fetcher.started.wait()
    await w.cancel(CancelRequest(request_id="r1"))
    fetcher.release.set()
    assert await chunks == []
    assert engine.aborted == ["r1"] and engine.generated == []
    assert not w._cancelled  # forgotten with the request


async def test_a_cancel_for_a_request_the_worker_never_had_is_not_remembered():
    w = worker(RecordingEngine(), SlowFetcher())
    await w.cancel(CancelRequest(request_id="gone"))
    assert not w._cancelled
