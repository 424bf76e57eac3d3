"""The decode worker's side of disaggregated prefill.

For each request it decides (``shared.policy.disagg``) whether to prefill locally or remotely.
Remotely: reserve the prompt's blocks (reusing the local prefix cache), publish a
RemotePrefillRequest on the JetStream prefill queue, keep decoding other requests, and when the
prefill worker's NIXL notification arrives let the request join the decode batch. Without a
notification by the deadline, or with a ``failed`` one, the request prefills locally.

Block safety: a prefill worker may start a write until ``write_deadline`` and a write lasts at most
``write_timeout_s``; the reserved blocks stay owned by the request (``keep_kv``) until that window
has closed, even if the request finished or was cancelled earlier, so no write, late or repeated,
can land in blocks that another request reuses.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import ValidationError

from shared.bus import Bus, WorkerRegistry
from shared.engine import AsyncEngine, EngineOutput, SamplingParams
from shared.policy.disagg import DisaggConfig, DisaggDecision, DisaggInput, decide_prefill
from shared.protocol import GenerateRequest, PrefillNotification, RemotePrefillRequest, Subjects
from shared.transfer import KvTransfer

log = logging.getLogger(__name__)

_QUEUE_INFO_MAX_AGE_S = 0.25  # the queue length steers a heuristic: a slightly old value is fine
_CLOCK_MARGIN_S = 0.5  # between the prefill worker's deadline check and its clock


@dataclass
class _Pending:
    request_id: str
    future: asyncio.Future[PrefillNotification | None]


class RemotePrefiller:
    def __init__(self, *, worker_id: str, model: str, bus: Bus, registry: WorkerRegistry, engine: AsyncEngine,
                 transfer: KvTransfer, subjects: Subjects, config: DisaggConfig, timeout_s: float,
                 write_timeout_s: float) -> None:
        if write_timeout_s + _CLOCK_MARGIN_S >= timeout_s:
            raise ValueError(f"remote prefill timeout ({timeout_s}s) must exceed the KV write timeout "
                             f"({write_timeout_s}s) by more than {_CLOCK_MARGIN_S}s")
        self.worker_id = worker_id
        self.model = model
        self.config = config
        self.timeout_s = timeout_s
        self.write_timeout_s = write_timeout_s
        self.transfer = transfer
        self._bus = bus
        self._registry = registry
        self._engine = engine
        self._subjects = subjects
        self._pending: dict[str, _Pending] = {}  # transfer id → waiting request
        self._by_request: dict[str, str] = {}  # request id → transfer id
        self._queue_len: tuple[float, int | None] = (0.0, None)
        self.num_remote = 0
        self.num_fallbacks = 0

    # -- deciding ---------------------------------------------------------------------------------
    async def has_prefill_workers(self) -> bool:
        return any(w.role == "prefill" and w.state == "ready" and w.model == self.model
                   for w in await self._registry.list())

    async def queue_length(self) -> int | None:
        """Requests waiting in the prefill queue (not yet taken by a worker); None: no queue."""
        at, value = self._queue_len
        if time.monotonic() - at > _QUEUE_INFO_MAX_AGE_S:
            try:
                info = await self._bus.consumer_info(self._subjects.prefill_stream, self._subjects.prefill_consumer)
            except Exception as exc:  # noqa: BLE001 — NATS reconnecting: prefill locally meanwhile
                log.warning("prefill queue state unavailable (%s): prefilling locally", exc)
                info = None
            value = None if info is None else info.num_pending
            self._queue_len = (time.monotonic(), value)
        return value

    async def start(self, request: GenerateRequest, params: SamplingParams) -> "RemoteHandle | None":
        """Reserve and enqueue a remote prefill if the policy says so; None: prefill locally."""
        prompt = request.prompt_token_ids
        if len(prompt) <= self.config.max_local_prefill_tokens:  # uncached part can only be shorter
            return None
        if not await self.has_prefill_workers():
            return None
        queue_len = await self.queue_length()
        if queue_len is None:
            return None
        decisions: list[DisaggDecision] = []
        config = self.config

        def decide(num_cached: int) -> bool:  # runs in the engine thread, with the local cache state
            decisions.append(decide_prefill(DisaggInput(time.time(), len(prompt), num_cached, queue_len,
                                                        block_size=self._engine.block_size), config))
            return decisions[-1].remote

        reserved_at = time.time()
        slot = await self._engine.reserve_remote_prefill(request.request_id, prompt, params, request.priority,
                                                         keep_kv=True, decide=decide)
        if slot is None:
            why = decisions[-1].reason if decisions and not decisions[-1].remote else "KV pool full now"
            log.debug("%s: local prefill (%s)", request.request_id, why)
            return None
        transfer_id = uuid.uuid4().hex
        window_end = reserved_at + self.timeout_s
        message = RemotePrefillRequest(
            request_id=request.request_id, transfer_id=transfer_id, model=self.model, prompt_token_ids=prompt,
            decode_worker_id=self.worker_id, block_ids=slot.block_ids, block_size=slot.block_size,
            num_cached_tokens=slot.num_cached_tokens,
            write_deadline=window_end - self.write_timeout_s - _CLOCK_MARGIN_S,
            write_timeout_s=self.write_timeout_s, priority=request.priority, created_at=reserved_at)
        pending = _Pending(request.request_id, asyncio.get_running_loop().create_future())
        self._pending[transfer_id] = pending
        self._by_request[request.request_id] = transfer_id
        handle = RemoteHandle(self, transfer_id, pending, window_end, decisions[-1].reason)
        try:
            await self._bus.js_publish(self._subjects.prefill_queue(), message)
        except Exception as exc:  # noqa: BLE001 — a full queue, NATS away: prefill here, now
            log.warning("%s: prefill queue publish failed (%s): prefilling locally", request.request_id, exc)
            pending.future.set_result(None)
        else:
            log.info("%s: remote prefill of %d uncached tokens (%d cached): %s", request.request_id,
                     len(prompt) - slot.num_cached_tokens, slot.num_cached_tokens, handle.reason)
        return handle

    # -- notifications ----------------------------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        """The client went away: stop waiting for the KV (the blocks stay held until the window
        closes all the same)."""
        transfer_id = self._by_request.get(request_id)
        pending = self._pending.get(transfer_id) if transfer_id else None
        if pending is not None and not pending.future.done():
            pending.future.set_result(None)

    def deliver(self, payload: bytes, num_bytes: int) -> None:
        try:
            note = PrefillNotification.from_bytes(payload)
        except ValidationError:
            log.warning("ignoring a malformed KV notification (%d bytes written)", num_bytes)
            return
        pending = self._pending.get(note.transfer_id)
        if pending is None or pending.future.done():
            log.info("%s: late or repeated KV notification (%s) ignored", note.request_id, note.status)
            return
        pending.future.set_result(note)

    async def receive_forever(self) -> None:
        """Drain the transfer's notifications: often while writes are awaited, rarely otherwise
        (the calls also drive the backend's progress, e.g. accepting a new writer's connection)."""
        while True:
            for note in self.transfer.get_notifications():
                self.deliver(note.message, note.num_bytes)
            await asyncio.sleep(0.002 if self._pending else 0.05)

    def _forget(self, transfer_id: str, request_id: str) -> None:
        self._pending.pop(transfer_id, None)
        if self._by_request.get(request_id) == transfer_id:
            del self._by_request[request_id]


class RemoteHandle:
    """One request whose prompt a prefill worker computes; ``outputs()`` streams its tokens."""

    def __init__(self, owner: RemotePrefiller, transfer_id: str, pending: _Pending, window_end: float,
                 reason: str) -> None:
        self._owner = owner
        self.transfer_id = transfer_id
        self._pending = pending
        self.window_end = window_end
        self.reason = reason
        self.kv_written = False

    async def outputs(self) -> AsyncIterator[EngineOutput]:
        owner, request_id = self._owner, self._pending.request_id
        engine = owner._engine
        note = None
        try:
            note = await asyncio.wait_for(self._pending.future, timeout=max(0.0, self.window_end - time.time()))
        except asyncio.TimeoutError:
            log.warning("%s: no KV from a prefill worker within %.1fs: prefilling locally", request_id,
                        owner.timeout_s)
        except BaseException:  # the handler was cancelled (shutdown): end the request
            owner._forget(self.transfer_id, request_id)
            engine.abort(request_id)
            engine.finish_remote_prefill(request_id, kv_written=False)
            engine.discard_stream(request_id)
            self._release_after_window()
            raise
        owner._forget(self.transfer_id, request_id)
        self.kv_written = note is not None and note.status == "ok"
        engine.finish_remote_prefill(request_id, kv_written=self.kv_written)
        if self.kv_written:
            owner.num_remote += 1
        else:
            owner.num_fallbacks += 1
            if note is not None:
                log.warning("%s: prefill worker %s gave up (%s): prefilling locally", request_id,
                            note.prefill_worker_id, note.message)
        try:
            async for out in engine.stream(request_id):
                yield out
        finally:
            self._release_after_window()

    def _release_after_window(self) -> None:
        """The blocks may be written until the window closes: only then back to the pool."""
        engine, request_id = self._owner._engine, self._pending.request_id
        asyncio.get_running_loop().call_later(max(0.0, self.window_end - time.time()), engine.release_kv, request_id)
