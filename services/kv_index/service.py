"""kv-index: KV event streams in, the prefix-hash → owners index in Redis, match queries answered.

On start it resumes the event stream after the last batch it applied (kept in Redis with the
data), or replays it from the beginning when Redis is empty or the stream was recreated, so a
restart rebuilds the index. Every ``sweep_interval_s`` it drops workers that are no longer in the
registry and have sent nothing for a registry TTL, and checks that Redis still holds the index:
Redis keeps no data, so after a Redis restart (or a batch it failed to apply while down) the index
is rebuilt by replaying the event stream from its start. Its retention (``events_max_age_s``,
``events_max_msgs``) bounds what comes back: blocks cached before it are missing from the index
until stored again, which costs routing quality, never a request. Meanwhile matches fail or come
back short and admission routes on load.
"""

from __future__ import annotations

import asyncio
import logging
import time

from shared.bus import Bus, Replay, WorkerRegistry
from shared.bus.errors import ServiceError
from shared.protocol import KvEventBatch, KvMatchRequest, KvMatchResult, Subjects, WorkerOverlap
from services.framework.lifecycle import every, run_bus_service, service_instance_id
from shared.telemetry.families import KvIndexMetrics
from shared.store import KvIndexStore, RedisKeys, check_connection, connect, is_unavailable
from services.kv_index.config import KvIndexSettings

log = logging.getLogger(__name__)


class KvIndexService:
    def __init__(self, settings: KvIndexSettings, bus: Bus, store: KvIndexStore,
                 registry: WorkerRegistry) -> None:
        self._settings = settings
        self._subjects = Subjects(settings.namespace)
        self._bus = bus
        self._store = store
        self._registry = registry
        self._last_seq: dict[str, int] = {}
        self.metrics = KvIndexMetrics.create(service_instance_id("kv-index"), settings.num_restarts)
        self._replay: Replay[KvEventBatch] | None = None
        self._is_index_lost = False  # a batch failed to apply: the index misses it
        self._is_redis_down = False  # a match found Redis not answering (said once, until it answers)

    async def start(self) -> None:
        s = self._subjects
        await self._bus.ensure_stream(s.kv_events_stream, [s.kv_events_all().subject],
                                      max_age_s=self._settings.events_max_age_s,
                                      max_msgs=self._settings.events_max_msgs)
        applied = await self._store.stream_seq()
        stream_last = (await self._bus.stream_state(s.kv_events_stream)).last_seq
        if applied > stream_last:  # the stream was recreated: our position means nothing now
            log.warning("index at stream seq %d but stream ends at %d: rebuilding", applied, stream_last)
            for worker_id in await self._store.workers():
                await self._store.drop_worker(worker_id)
            applied = 0
        self._last_seq = await self._store.worker_seqs()
        log.info("replaying KV events from stream seq %d", applied + 1)
        self._replay = await self._bus.replay(s.kv_events_all(), s.kv_events_stream, self.on_batch,
                                              start_seq=applied + 1 if applied else 0)
        await self._store.mark_built()
        await self._bus.serve(s.kvindex_match(), self.match, queue="kv-index")

    async def on_batch(self, batch: KvEventBatch, stream_seq: int) -> None:
        try:
            await self._apply(batch, stream_seq)
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            if not self._is_index_lost:  # Redis down: check_index rebuilds once it is back
                log.warning("cannot apply KV events (%r): the index is rebuilt once Redis answers", exc)
            self._is_index_lost = True

    async def check_index(self) -> None:
        """Rebuild the index from the start of the event stream if Redis lost it (restarted) or
        missed a batch; raises while Redis does not answer (the next round tries again)."""
        if not self._is_index_lost and await self._store.is_built():
            return
        assert self._replay is not None, "check_index before start"
        log.warning("Redis lost the index (restarted, or down while events came): rebuilding it from "
                    "the KV event stream")
        await self._store.mark_built(False)  # a rebuild cut short by Redis failing again starts over
        self._is_index_lost = False
        await self._replay.stop()  # no batch applies while the old entries go
        for worker_id in await self._store.workers():
            await self._store.drop_worker(worker_id)
        self._last_seq = {}
        await self._replay.start(0)
        await self._store.mark_built()

    async def _apply(self, batch: KvEventBatch, stream_seq: int) -> None:
        w, first = batch.worker_id, batch.events[0].seq
        last = self._last_seq.get(w, 0)
        if first == 1 and last > 0:
            log.info("worker %s restarted (seq back to 1): dropping its old entries", w)
            await self._store.drop_worker(w)
        elif last and first != last + 1:
            self.metrics.gaps.inc()
            log.warning("worker %s: KV event gap, expected seq %d, got %d", w, last + 1, first)
        await self._store.apply(batch, stream_seq, now=time.time())
        self._last_seq[w] = batch.events[-1].seq
        self.metrics.batches.inc()
        self.metrics.events.inc(len(batch.events))

    async def match(self, request: KvMatchRequest) -> KvMatchResult:
        try:
            with self.metrics.match_latency.time():
                matches = await self._store.match_tiers(request.block_hashes)
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            if not self._is_redis_down:  # one line an outage, not a traceback a lookup
                log.warning("Redis is not answering (%s): matches fail until it is back, admission routes on load",
                            exc)
                self._is_redis_down = True
            raise ServiceError("rejected", f"the KV index's Redis is not answering: {exc}") from None
        if self._is_redis_down:
            log.info("Redis answers matches again")
            self._is_redis_down = False
        self.metrics.matches.inc()
        self.metrics.queried_blocks.inc(len(request.block_hashes))
        self.metrics.matched_blocks.inc(max((m.num_blocks for m in matches.values()), default=0))
        return KvMatchResult(overlaps=[
            WorkerOverlap(worker_id=w, num_blocks=m.num_blocks, num_host_blocks=m.num_host_blocks,
                          num_disk_blocks=m.num_disk_blocks)
            for w, m in sorted(matches.items()) if m.num_blocks > 0])

    async def sweep(self) -> list[str]:
        """Drop every worker that left the registry and has been silent for a TTL."""
        alive = {w.worker_id for w in await self._registry.list()}
        now, dropped = time.time(), []
        for worker_id, last_event_at in (await self._store.workers()).items():
            if worker_id not in alive and now - last_event_at > self._registry.ttl_s:
                num_blocks = await self._store.drop_worker(worker_id)
                self._last_seq.pop(worker_id, None)
                log.info("worker %s left the registry: dropped its %d blocks", worker_id, num_blocks)
                dropped.append(worker_id)
                self.metrics.dropped_workers.inc()
        return dropped

    async def run_forever(self) -> None:
        await asyncio.gather(every(self._settings.sweep_interval_s, self.check_index, "index check"),
                             every(self._settings.sweep_interval_s, self.sweep, "sweep"))


async def run(settings: KvIndexSettings, stop: asyncio.Event) -> None:
    redis = connect(settings.redis_url)
    try:
        await check_connection(redis, settings.redis_url)
        store = KvIndexStore(redis, RedisKeys(settings.namespace))
        await run_bus_service("kv-index", settings, stop,
                              lambda bus, registry: KvIndexService(settings, bus, store, registry))
    finally:
        await redis.aclose()
