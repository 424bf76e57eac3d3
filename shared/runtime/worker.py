"""What every engine-running worker (decode, prefill) does besides its own job: warm up before it
takes traffic, and hand the engine's KV events to kv-index over JetStream."""

from __future__ import annotations

import asyncio
import logging
import time

from shared.bus import Bus
from shared.engine import AsyncEngine, SamplingParams
from shared.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, SequencedEvent
from shared.protocol import (AllBlocksClearedEvent, BlockRemovedEvent, BlockStoredEvent, Endpoint,
                             KvEventBatch)

log = logging.getLogger(__name__)

MAX_EVENTS_PER_BATCH = 512


async def warm_up(engine: AsyncEngine, worker_id: str, num_requests: int) -> None:
    """Concurrent throwaway requests of a few lengths: compiles/allocates every path once."""
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
    log.info("warm-up: %d requests in %.2fs", num_requests, time.monotonic() - started)


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
