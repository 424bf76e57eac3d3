"""AsyncEngine: the engine steps in its own thread; ``generate()`` streams tokens to asyncio.

Requests and aborts are handed to the engine thread through a locked inbox; outputs go back to each
caller's event loop with ``call_soon_threadsafe``, once per step per loop. Nothing on the token
path blocks the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from shared.engine import cpu_threads
from shared.engine.config import EngineConfig
from shared.engine.engine import EngineOutput, EngineStats, LLMEngine
from shared.engine.reservations import PrefixFetchSlot, RemotePrefillSlot
from shared.engine.step_stats import StepObserver
from shared.engine.errors import EngineDeadError
from shared.engine.request import SamplingParams
from shared.kvcache.events import KvEventSink
from shared.kvcache.layout import KvCacheSpec

log = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    keep_kv: bool = False
    deadline: float | None = None


@dataclass
class _Call:
    """Run ``fn(*args)`` in the engine thread between steps; its result resolves ``future``."""

    fn: Callable[..., Any]
    args: tuple
    future: concurrent.futures.Future


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_dead: Callable[[BaseException], None] | None = None) -> None:
        """``on_dead(exc)``: called on the engine thread when a step raises, before the callers are
        failed (a worker exits there, so that its requests move as a killed worker's do)."""
        self._engine = engine
        self._reservations = engine.reservations  # touched in the engine thread only (``_in_thread``)
        self._on_dead = on_dead
        self._cv = threading.Condition()
        self._inbox: list[_Add | _Call | str] = []  # adds, calls, and request ids to abort
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats = engine.stats()
        # requests posted that the last snapshot does not show yet (id -> priority, prompt tokens)
        self._unseen: dict[str, tuple[int, int]] = {}
        # the engine thread takes the intra-op threads and this thread gives its own up (why:
        # shared/engine/cpu_threads.py); restored by shutdown() when called from this thread
        num_threads = cpu_threads.engine_thread_count(engine.config.num_threads)
        adopted = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(num_threads, adopted), name="tandem-engine",
                                        daemon=True)
        self._thread.start()
        adopted.wait()
        self._handed_over = (threading.get_ident(), cpu_threads.release_calling_thread())

    @classmethod
    def start(cls, config: EngineConfig, artifact_store=None,
              on_dead: Callable[[BaseException], None] | None = None) -> "AsyncEngine":
        """``artifact_store``: see ``LLMEngine``."""
        return cls(LLMEngine.from_config(config, artifact_store), on_dead)

    # -- what the engine is (fixed once built) ----------------------------------------------------
    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def model_id(self) -> str:
        return self._engine.model_id

    @property
    def block_size(self) -> int:
        return self._engine.block_size

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def kv_namespace(self) -> bytes:
        return self._engine.kv_namespace

    @property
    def kv_spec(self) -> KvCacheSpec:
        return self._engine.kv_spec

    @property
    def kv_cache(self) -> torch.Tensor:
        """The KV pool a transfer registers once (``register_kv_pool``) and moves blocks of by id."""
        return self._engine.kv_cache

    @property
    def tensor_parallel_size(self) -> int:
        return self._engine.tensor_parallel_size

    @property
    def pipeline_parallel_size(self) -> int:
        return self._engine.pipeline_parallel_size

    @property
    def rank_pids(self) -> list[int]:
        """The process ids of a tensor-parallel group's ranks 1.. (empty for one process)."""
        return self._engine.rank_pids

    @property
    def group_address(self) -> str | None:
        return self._engine.group_address

    # -- load and what it measured ----------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Requests in the batch at the last step (cheap: no snapshot copied, for per-token use)."""
        return self._stats.num_running

    def stats(self) -> EngineStats:
        """The snapshot taken after the last step, with the requests posted since counted as
        waiting: a step of a full batch takes a fifth of a second on a CPU, and a request added
        meanwhile was in no load report, so admission saw free slots a burst had already taken.
        (How decode steps run is read now: it can change while the engine idles.)"""
        with self._cv:
            unseen = list(self._unseen.values())
        stats = dataclasses.replace(self._stats, decode_step=self._engine.decode_step())
        if not unseen:
            return stats
        waiting, tokens = dict(stats.num_waiting_by_priority), dict(stats.queued_prefill_tokens)
        for priority, num_tokens in unseen:
            waiting[priority] = waiting.get(priority, 0) + 1
            tokens[priority] = tokens.get(priority, 0) + num_tokens
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + len(unseen),
                                   num_waiting_by_priority=waiting, queued_prefill_tokens=tokens)

    async def forget_prefill_rate(self, keep_as_warmup: bool = False) -> None:
        """See ``StepStats.forget_prefill_rate``; ``stats()`` shows it once this returns."""
        await self._in_thread(self._forget_prefill_rate, keep_as_warmup)

    def add_kv_event_sink(self, sink: KvEventSink) -> None:
        self._engine.add_kv_event_sink(sink)

    def add_step_observer(self, observe: StepObserver) -> None:
        """See ``StepStats.add_observer``: called in the engine thread."""
        self._engine.add_step_observer(observe)

    # -- requests ---------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, *, keep_kv: bool = False,
                       deadline: float | None = None) -> AsyncIterator[EngineOutput]:
        """Yield one EngineOutput per generated token; the last has ``finish_reason`` set.
        Invalid input raises before anything is queued; leaving the loop early aborts the request.
        ``keep_kv`` holds the finished request's blocks until ``release_kv`` (prefill side)."""
        self._check_alive()
        self._engine.validate(prompt_token_ids, params)
        self._open_stream(request_id)
        self._post(_Add(request_id, list(prompt_token_ids), params, priority, keep_kv, deadline))
        async for out in self.stream(request_id):
            yield out

    async def stream(self, request_id: str) -> AsyncIterator[EngineOutput]:
        """The outputs of a request whose stream is open (``generate`` / ``reserve_remote_prefill``)."""
        queue = self._streams[request_id][1]
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

    def discard_stream(self, request_id: str) -> None:
        """Forget a request's output stream that nobody will read (it was aborted)."""
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (idempotent; unknown ids are ignored)."""
        self._post(request_id)

    # -- KV blocks other workers write or read (shared.engine.reservations) -----------------------
    async def reserve_remote_prefill(self, request_id: str, prompt_token_ids: list[int],
                                     params: SamplingParams, priority: int = 0, *, keep_kv: bool = False,
                                     decide: Callable[[int], bool] | None = None,
                                     deadline: float | None = None) -> RemotePrefillSlot | None:
        """Decode side of remote prefill: reserve the prompt's blocks (see KvReservations;
        ``decide`` runs in the engine thread). On a slot, read the request's tokens with
        ``stream(request_id)`` after ``finish_remote_prefill``."""
        self._check_alive()
        self._engine.validate(prompt_token_ids, params)
        self._open_stream(request_id)
        try:
            slot = await self._in_thread(functools.partial(
                self._reservations.reserve_remote_prefill, request_id, list(prompt_token_ids), params, priority,
                keep_kv=keep_kv, decide=decide, deadline=deadline))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        if slot is None:
            self._streams.pop(request_id, None)
        return slot

    def finish_remote_prefill(self, request_id: str, kv_written: bool) -> None:
        """The transfer into a reserved request's blocks completed (``kv_written``) or was given up
        on (prefill locally). Safe to call for an aborted or unknown request."""
        self._post_in_thread(self._finish_remote_prefill, request_id, kv_written)

    async def request_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (see ``KvReservations.request_block_ids``)."""
        return await self._in_thread(self._reservations.request_block_ids, request_id)

    def release_kv(self, request_id: str) -> None:
        """Free the blocks a finished ``keep_kv`` request holds."""
        self._post_in_thread(self._reservations.release_kv, request_id)

    async def reserve_prefix_fetch(self, fetch_id: str, prompt_token_ids: list[int],
                                   num_blocks: int) -> PrefixFetchSlot | None:
        """Hold blocks for a peer to write the prompt's prefix into (see KvReservations); end it
        with ``finish_prefix_fetch``."""
        return await self._in_thread(self._reservations.reserve_prefix_fetch, fetch_id, list(prompt_token_ids),
                                     num_blocks)

    def finish_prefix_fetch(self, fetch_id: str, num_written: int) -> None:
        """End a ``reserve_prefix_fetch`` (see KvReservations), in order with the calls before it."""
        self._post_in_thread(self._reservations.finish_prefix_fetch, fetch_id, num_written)

    async def read_prefix_from_disk(self, block_hashes: list[int]) -> bool:
        """Start reading the prefix this worker keeps on disk; True while reads are under way
        (see KvReservations)."""
        return await self._in_thread(self._reservations.read_prefix_from_disk, list(block_hashes))

    async def lend_prefix(self, lend_id: str, block_hashes: list[int]) -> list[int]:
        """Pin the leading run of ``block_hashes`` cached here for a peer to read; their block ids
        (see KvReservations). ``return_prefix`` unpins them."""
        return await self._in_thread(self._reservations.lend_prefix, lend_id, list(block_hashes))

    def return_prefix(self, lend_id: str) -> None:
        """Unpin the blocks of a ``lend_prefix`` (see KvReservations), in order with the calls before it."""
        self._post_in_thread(self._reservations.return_prefix, lend_id)

    def open_group_transfer(self, name: str) -> concurrent.futures.Future:
        """A tensor-parallel group's NIXL agents, one per rank, made in the engine thread (where rank
        0 talks to the others): the future of ``LLMEngine.open_group_transfer``, from any thread."""
        return self._submit(self._engine.open_group_transfer, name)

    def send_group_kv(self, target: bytes, local_ids: list[int], remote_ids: list[int], notify: bytes,
                      timeout_s: float) -> concurrent.futures.Future:
        """``LLMEngine.send_group_kv`` in the engine thread, between two steps: its future, from any thread."""
        return self._submit(self._engine.send_group_kv, target, local_ids, remote_ids, notify, timeout_s)

    # -- the engine thread, for what has no method above ------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between two steps and return its result. For
        tests and tools that look inside the engine; services use the typed methods above."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """``call`` from any thread: the future of ``fn(engine)``, run in the engine thread between
        two steps."""
        return self._submit(fn, self._engine)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._engine.close()  # the disk tier keeps the cache for the next start
        thread_id, num_threads = self._handed_over
        if thread_id == threading.get_ident():
            cpu_threads.restore(num_threads)

    # -- posting to the engine thread -------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")

    def _open_stream(self, request_id: str) -> None:
        if request_id in self._streams:
            raise ValueError(f"duplicate request_id {request_id!r}")
        self._streams[request_id] = (asyncio.get_running_loop(), asyncio.Queue())

    async def _in_thread(self, fn: Callable[..., Any], *args) -> Any:
        """``fn(*args)`` run in the engine thread between two steps: its result."""
        return await asyncio.wrap_future(self._submit(fn, *args))

    def _submit(self, fn: Callable[..., Any], *args) -> concurrent.futures.Future:
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(_Call(fn, args, future))
        return future

    def _post_in_thread(self, fn: Callable[..., Any], *args) -> None:
        """``fn(*args)`` in the engine thread, in order with the calls before it; nobody waits for it."""
        self._post(_Call(fn, args, concurrent.futures.Future()))

    def _post(self, item: _Add | _Call | str) -> None:
        with self._cv:
            if isinstance(item, _Add):
                self._unseen[item.request_id] = (item.priority, len(item.prompt_token_ids))
                # read between the layers of a step: a lower priority's prefill stops for it
                self._engine.announce_request(item.priority)
            self._inbox.append(item)
            self._cv.notify()

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self, num_threads: int, adopted: threading.Event) -> None:
        try:
            cpu_threads.adopt(num_threads)
        finally:
            adopted.set()
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._stopping or self._engine.has_unfinished_requests()):
                        self._cv.wait()
                    if self._stopping:
                        return
                    inbox, self._inbox = self._inbox, []
                    self._engine.clear_announced()  # added below, before the next step
                outputs = self._apply(inbox)
                outputs.extend(self._engine.step())
                self._stats = self._engine.stats()
                with self._cv:
                    for item in inbox:
                        if isinstance(item, _Add):
                            self._unseen.pop(item.request_id, None)
                self._deliver(outputs)
        except BaseException as exc:  # the engine is broken: fail every caller, never hang them
            log.exception("engine thread crashed")
            self._dead = exc
            if self._on_dead is not None:
                self._on_dead(exc)
            err = EngineDeadError(f"engine crashed: {exc!r}")
            for rid in list(self._streams):
                self._deliver_one(rid, err)

    def _apply(self, inbox: list[_Add | _Call | str]) -> list[EngineOutput]:
        outputs = []
        for item in inbox:
            if isinstance(item, str):
                out = self._engine.abort_request(item)
                if out is not None:
                    outputs.append(out)
            elif isinstance(item, _Call):
                try:
                    item.future.set_result(item.fn(*item.args))
                except Exception as exc:
                    item.future.set_exception(exc)
            else:
                try:
                    self._engine.add_request(item.request_id, item.prompt_token_ids, item.params,
                                            item.priority, keep_kv=item.keep_kv, deadline=item.deadline)
                except Exception as exc:  # validated by the caller already; report rather than crash
                    self._deliver_one(item.request_id, exc)
        return outputs

    def _finish_remote_prefill(self, request_id: str, kv_written: bool) -> None:
        out = self._reservations.finish_remote_prefill(request_id, kv_written)
        if out is not None:
            self._deliver([out])

    def _forget_prefill_rate(self, keep_as_warmup: bool) -> None:
        self._engine.forget_prefill_rate(keep_as_warmup)
        self._stats = self._engine.stats()

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
