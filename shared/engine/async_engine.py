"""AsyncEngine: the engine steps in its own thread; ``generate()`` streams tokens to asyncio.

Requests and aborts are handed to the engine thread through a locked inbox; outputs go back to each
caller's event loop with ``call_soon_threadsafe``, once per step per loop. Nothing on the token
path blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shared.engine.config import EngineConfig
from shared.engine.engine import EngineOutput, EngineStats, LLMEngine
from shared.engine.errors import EngineDeadError
from shared.engine.request import SamplingParams
from shared.kvcache.events import KvEventSink

log = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[_Add | str] = []  # adds, and request ids to abort
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine.from_config(config))

    # -- properties the services use --------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def kv_namespace(self) -> bytes:
        return self.engine.kv_namespace

    def stats(self) -> EngineStats:
        return self._stats

    def add_kv_event_sink(self, sink: KvEventSink) -> None:
        self.engine.add_kv_event_sink(sink)

    # -- requests ---------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[EngineOutput]:
        """Yield one EngineOutput per generated token; the last has ``finish_reason`` set.
        Invalid input raises before anything is queued; leaving the loop early aborts the request."""
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")
        self.engine.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise ValueError(f"duplicate request_id {request_id!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._post(_Add(request_id, list(prompt_token_ids), params, priority))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (idempotent; unknown ids are ignored)."""
        self._post(request_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    def _post(self, item: _Add | str) -> None:
        with self._cv:
            self._inbox.append(item)
            self._cv.notify()

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._stopping or self.engine.has_unfinished_requests()):
                        self._cv.wait()
                    if self._stopping:
                        return
                    inbox, self._inbox = self._inbox, []
                outputs = self._apply(inbox)
                outputs.extend(self.engine.step())
                self._stats = self.engine.stats()
                self._deliver(outputs)
        except BaseException as exc:  # the engine is broken: fail every caller, never hang them
            log.exception("engine thread crashed")
            self._dead = exc
            err = EngineDeadError(f"engine crashed: {exc!r}")
            for rid in list(self._streams):
                self._deliver_one(rid, err)

    def _apply(self, inbox: list[_Add | str]) -> list[EngineOutput]:
        outputs = []
        for item in inbox:
            if isinstance(item, str):
                out = self.engine.abort_request(item)
                if out is not None:
                    outputs.append(out)
                continue
            try:
                self.engine.add_request(item.request_id, item.prompt_token_ids, item.params, item.priority)
            except Exception as exc:  # validated by the caller already; report rather than crash
                self._deliver_one(item.request_id, exc)
        return outputs

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, EngineOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: its callers are gone
                pass

    def _deliver_one(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            try:
                stream[0].call_soon_threadsafe(stream[1].put_nowait, item)
            except RuntimeError:
                pass


def _put_all(items: list[tuple[asyncio.Queue, EngineOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)
