"""What every engine-running worker (decode, prefill) does besides its own job: warm up before it
takes traffic, report its load, hand the engine's KV events to kv-index over JetStream.

The KV event stream and the load sequence belong to the process, not to a role: they outlive a
role flip (``services.worker.roles``), so kv-index sees no gap and the cluster view no older ``seq``."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time

from shared.bus import Bus, WorkerRegistry
from shared.engine import AsyncEngine, SamplingParams
from shared.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, SequencedEvent
from shared.protocol import (AllBlocksClearedEvent, BlockRemovedEvent, BlockStoredEvent, Endpoint,
                             KvEventBatch, Subjects, WorkerInfo, WorkerLoad)
from shared.protocol.workers import KvTierLoad, Role
from services.worker.settings import EngineWorkerSettings
from shared.telemetry import tracing

log = logging.getLogger(__name__)

MAX_EVENTS_PER_BATCH = 512


CALIBRATION_TOKENS = 512  # a prompt of a length real traffic has: short ones measure per-step overhead


async def warm_up(engine: AsyncEngine, worker_id: str, num_requests: int, measure_rate: bool = True) -> None:
    """Concurrent throwaway requests of a few lengths: compiles/allocates every path once. Then the
    prefill rate is measured on warm kernels (``measure_warmup_prefill_rate``), so that admission
    predicts the first requests after ``ready`` instead of admitting them all on no rate."""
    if num_requests == 0:
        return
    vocab = engine.tokenizer.vocab_size
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> None:
        length = min(8 + 24 * i, engine.max_model_len - 8)
        prompt = [(7 + 31 * i + j) % vocab for j in range(length)]
        async for _ in engine.generate(f"warmup-{worker_id}-{i}", prompt, params):
            pass

    started = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(num_requests)))
    if not measure_rate:
        await engine.forget_prefill_rate()  # warm-up's short prompts on cold kernels measure no real rate
        log.info("warm-up: %d requests in %.2fs", num_requests, time.monotonic() - started)
        return
    rate = await measure_warmup_prefill_rate(engine, worker_id)
    log.info("warm-up: %d requests in %.2fs; prefill %s", num_requests, time.monotonic() - started,
             f"{rate:.0f} tokens/s alone" if rate else "rate not measured")


async def measure_warmup_prefill_rate(engine: AsyncEngine, worker_id: str) -> float | None:
    """Two prompts of ``CALIBRATION_TOKENS`` (fewer if the context or KV pool is small) alone on the
    engine: the first brings that shape's kernels in and the rate so far (warm-up's short prompts
    on cold kernels) is dropped, the second measures it. It is kept apart as the warm-up's rate and the
    measured rate starts afresh with real prompts: warm-up may run while sibling processes load,
    so its rate stands in only until real work measures one (admission) and is not averaged into
    the fleet's capacity (the autoscaler). Prompts of tokens no other warm-up request used, so
    nothing is cached."""
    pool_tokens = engine.stats().num_blocks_total * engine.block_size
    length = max(min(CALIBRATION_TOKENS, engine.max_model_len - 8, pool_tokens // 2), 1)
    vocab = engine.tokenizer.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for run in range(2):
        await engine.forget_prefill_rate()
        prompt = [(1000 + 7919 * run + 13 * j) % vocab for j in range(length)]
        async for _ in engine.generate(f"warmup-{worker_id}-rate-{run}", prompt, params):
            pass
    await engine.forget_prefill_rate(keep_as_warmup=True)
    return engine.stats().warmup_prefill_tokens_per_s


class LoopSink:
    """KvEventSink handing events from the engine thread to the event loop (never blocks)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self._loop, self._queue = loop, queue

    def emit(self, event: SequencedEvent) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)


async def publish_kv_events_forever(bus: Bus, endpoint: Endpoint[KvEventBatch, object], worker_id: str,
                                    events: asyncio.Queue[SequencedEvent]) -> None:
    """Batch the queued engine events into ``KvEventBatch`` messages on ``endpoint``."""
    while True:
        batch_events = [await events.get()]
        while not events.empty() and len(batch_events) < MAX_EVENTS_PER_BATCH:
            batch_events.append(events.get_nowait())
        batch = KvEventBatch(worker_id=worker_id, events=[kv_event(e) for e in batch_events])
        for attempt in range(5):
            try:
                await bus.js_publish(endpoint, batch)
                break
            except Exception as exc:  # noqa: BLE001 — kv-index sees the gap if we give up
                log.warning("KV event publish failed (attempt %d): %s", attempt + 1, exc)
                await asyncio.sleep(0.2 * (attempt + 1))


def kv_event(ev: SequencedEvent):
    e = ev.event
    if isinstance(e, BlockStored):
        return BlockStoredEvent(seq=ev.seq, timestamp=ev.timestamp, block_hashes=list(e.block_hashes),
                                parent_hash=e.parent_hash, tier=e.tier)
    if isinstance(e, BlockRemoved):
        return BlockRemovedEvent(seq=ev.seq, timestamp=ev.timestamp, block_hashes=list(e.block_hashes),
                                 tier=e.tier)
    assert isinstance(e, AllBlocksCleared), f"unknown KV event {e!r}"
    return AllBlocksClearedEvent(seq=ev.seq, timestamp=ev.timestamp)


async def start_kv_events(bus: Bus, settings: EngineWorkerSettings, engine: AsyncEngine,
                          events: asyncio.Queue[SequencedEvent]) -> None:
    """The KV event stream exists, and the engine's events queue up in ``events`` for it."""
    s = Subjects(settings.namespace)
    await bus.ensure_stream(s.kv_events_stream, [s.kv_events_all().subject],
                            max_age_s=settings.events_max_age_s, max_msgs=settings.events_max_msgs)
    engine.add_kv_event_sink(LoopSink(asyncio.get_running_loop(), events))


class EngineWorker:
    """The state decode and prefill workers share. A subclass sets ``role`` and builds its
    ``info()`` and ``load()`` from ``_info(...)`` and ``_load(...)``. ``load_seq``: the process's
    load-report counter, shared by the roles it serves one after the other."""

    role: Role

    def __init__(self, settings: EngineWorkerSettings, bus: Bus, registry: WorkerRegistry,
                 engine: AsyncEngine, *, load_seq: itertools.count | None = None) -> None:
        self._settings = settings
        self._subjects = Subjects(settings.namespace)
        self._bus = bus
        self._registry = registry
        self.engine = engine
        self.worker_id = settings.worker_id
        self.state = "starting"
        self._started_at = time.time()
        self._load_seq = load_seq if load_seq is not None else itertools.count(1)

    def info(self) -> WorkerInfo:
        raise NotImplementedError

    def load(self) -> WorkerLoad:
        raise NotImplementedError

    def _info(self, **subjects: str) -> WorkerInfo:
        stats = self.engine.stats()
        return WorkerInfo(
            worker_id=self.worker_id, role=self.role, state=self.state, model=self._settings.model,
            block_size=self.engine.block_size, max_model_len=self.engine.max_model_len,
            num_blocks_total=stats.num_blocks_total, max_num_seqs=stats.max_num_seqs,
            control_subject=self._subjects.control(self.worker_id).subject,
            kv_namespace_hex=self.engine.kv_namespace.hex(), host=socket.gethostname(),
            host_id=self._settings.host_id, pid=os.getpid(), started_at=self._started_at,
            num_restarts=self._settings.num_restarts,
            warmup_prefill_tokens_per_s=stats.warmup_prefill_tokens_per_s,
            tensor_parallel_size=self.engine.tensor_parallel_size,
            pipeline_parallel_size=self.engine.pipeline_parallel_size, rank_pids=self.engine.rank_pids,
            group_address=self.engine.group_address, **subjects)

    def _load(self, **fields) -> WorkerLoad:
        stats = self.engine.stats()
        return WorkerLoad(
            worker_id=self.worker_id, role=self.role, seq=next(self._load_seq), timestamp=time.time(),
            num_running=stats.num_running, num_waiting=stats.num_waiting,
            num_blocks_used=stats.num_blocks_used, num_blocks_total=stats.num_blocks_total,
            num_cached_blocks=stats.num_cached_blocks, num_held=stats.num_held, max_num_seqs=stats.max_num_seqs,
            num_prompt_tokens_total=stats.num_prompt_tokens,
            num_generated_tokens_total=stats.num_generated_tokens,
            num_cached_prompt_tokens_total=stats.num_cached_prompt_tokens,
            queued_prefill_tokens=stats.queued_prefill_tokens, num_waiting_by_priority=stats.num_waiting_by_priority,
            num_running_by_priority=stats.num_running_by_priority,
            prefill_tokens_per_s=stats.prefill_tokens_per_s, prefill_cost_s=stats.prefill_cost_s,
            decode_step=stats.decode_step,
            kv_tiers=KvTierLoad.model_validate({k: int(v) for k, v in stats.kv_tiers.items()
                                                if k in KvTierLoad.model_fields}) if stats.kv_tiers else None,
            **fields)

    async def warm_up(self) -> None:
        await warm_up(self.engine, self.worker_id, self._settings.num_warmup_requests,
                      self._settings.warmup_prefill_rate)

    async def publish_load(self) -> None:
        try:
            with tracing.untraced():  # also sent while serving a request, yet part of none
                await self._bus.publish(self._subjects.load(self.role, self.worker_id), self.load())
        except Exception as exc:  # noqa: BLE001 — reconnecting: the next report will do
            log.warning("load report failed: %s", exc)
