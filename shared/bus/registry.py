"""The worker registry: a NATS KV bucket whose entries expire unless heartbeated.

A worker puts its ``WorkerInfo`` under its id every ``ttl/3`` seconds; the bucket's ``ttl``
(JetStream ``max_age``) removes the entry of a worker that stops heartbeating (killed, hung,
partitioned) without anyone having to notice.

Readers either list the bucket (one KV scan per call), or, opened with ``watch=True``, keep a live
copy from a KV watch and answer ``list()`` from memory. Expiry by ``max_age`` sends watchers
nothing, so the copy drops an entry itself once its last put is older than the TTL. After a NATS
reconnect the watch starts over (its consumer may have died with the server) and the copy is
rebuilt from the bucket; until then it keeps what it had, each entry aging out by its TTL.

A watch can also die while the connection lives: its consumer is kept by one server of the
bucket's cluster, which may not be the one the client is connected to. Killing that server leaves
the client connected and the watch silent; nats-py notices only after two missed idle heartbeats
(10 s), more than a TTL, so every worker would leave the copy meanwhile. A watchdog therefore
starts the watch over once it has heard nothing for half a TTL (every worker puts every third of
one), and again while that fails (the bucket electing a new leader).

Losing one member of a 3-server NATS cluster can leave the registry's raft group without a
leader for tens of seconds: the bucket can be neither read nor written, the workers' heartbeats
fail, and every worker would leave every copy at once, the cluster refusing all work although the
workers and core NATS serve on. So from the moment the watchdog starts a silent watch over until
that succeeds, the copy answers as of the moment the watch last heard from the bucket (for up to
``STALE_HOLD_S``): a missing heartbeat then says nothing about the worker. When the restart
succeeds after failing, the entries the bucket dropped meanwhile (its ``max_age``) are kept, aged
as if the clock had stood still, until their workers' next beat. A worker that dies during the
outage stays listed until the watch is back (or the hold ends); a request sent to it meanwhile
gets "no responders" and is admitted again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.js.kv import KV_DEL, KV_PURGE
from pydantic import ValidationError

from shared.bus.bus import Bus
from shared.bus.kv import KvBucket
from shared.protocol.workers import WorkerInfo

log = logging.getLogger(__name__)

STALE_HOLD_S = 60.0  # how long a copy whose watch cannot be started over keeps its entries' ages


class WorkerRegistry:
    def __init__(self, kv: KvBucket, ttl_s: float) -> None:
        self._kv = kv
        self.ttl_s = ttl_s
        self._copy: dict[str, tuple[WorkerInfo, float]] | None = None  # id → (info, put at)
        self._watcher = None
        self._watch_task: asyncio.Task | None = None
        self._watch_lock = asyncio.Lock()
        self._watchdog_task: asyncio.Task | None = None
        self._heard_at = 0.0  # monotonic: the watch's last entry, or its (re)start
        self._stale = False  # the watch went silent and has not been started over yet
        self._num_failed_restarts = 0  # in a row: the bucket cannot be read (no leader, say)
        self.num_watch_restarts = 0  # by the watchdog

    @classmethod
    async def open(cls, bus: Bus, bucket: str, *, ttl_s: float = 6.0,
                   watch: bool = False) -> "WorkerRegistry":
        """Bind to the bucket, creating it with ``ttl_s`` if it does not exist (an existing
        bucket keeps the TTL it was created with). ``watch``: keep a live copy (see module doc);
        returns once the copy holds the bucket's current entries."""
        kv = await bus.key_value(bucket, ttl_s=ttl_s)
        registry = cls(kv, await kv.ttl_s() or ttl_s)
        if watch:
            await registry._start_watch()
            bus.link.on_resume(f"registry watch of {bucket} #{id(registry)}", registry._start_watch)
            registry._watchdog_task = asyncio.create_task(registry._watchdog(bus, bucket))
        return registry

    async def _start_watch(self) -> None:
        """(Re)build the copy from a new watch, then follow it; replaces an earlier watch."""
        async with self._watch_lock:  # a reconnect's resume and the watchdog may both start one
            watcher = await self._kv.watch_all()
            copy: dict[str, tuple[WorkerInfo, float]] = {}
            try:
                while (entry := await watcher.updates(timeout=10)) is not None:  # None: initial values done
                    self._apply(copy, entry)
            except BaseException:
                await _stop_watcher(watcher)
                raise
            await self._stop_watch()
            if self._num_failed_restarts and self._copy:  # the workers' heartbeats failed too: the clock
                # stood still for the entries the bucket dropped meanwhile (max_age) until their next beat
                paused_s = min(time.monotonic() - self._heard_at, STALE_HOLD_S)
                for key, (info, put_at) in self._copy.items():
                    copy.setdefault(key, (info, put_at + paused_s))
            self._copy, self._watcher = copy, watcher
            self._stale, self._num_failed_restarts = False, 0
            self._heard_at = time.monotonic()
            self._watch_task = asyncio.create_task(self._follow(watcher, copy))

    async def _watchdog(self, bus: Bus, bucket: str) -> None:
        """Start the watch over when it has been silent for half a TTL (see the module doc); with
        no entry to expect (an empty copy) a full TTL. Runs until the bus closes."""
        while not bus.link.is_closed:
            await asyncio.sleep(self.ttl_s / 6)
            silent_s = time.monotonic() - self._heard_at
            if not bus.nc.is_connected or silent_s < self.ttl_s / (2 if self._copy else 1):
                continue  # a reconnect starts the watch over itself (``on_resume``)
            self._stale = True
            try:
                await self._start_watch()
                self.num_watch_restarts += 1
                log.log(logging.INFO if self._copy else logging.DEBUG,
                        "registry watch of %s silent for %.1fs: started over (%d entries)", bucket, silent_s,
                        len(self._copy or {}))
            except Exception as exc:  # noqa: BLE001 — no leader yet, timeouts: the next tick tries again
                self._num_failed_restarts += 1
                if self._num_failed_restarts == 1 and self._copy:
                    log.warning("registry %s unavailable: its %d entries are kept as of %.1fs ago for up to "
                                "%.0fs", bucket, len(self._copy), time.monotonic() - self._heard_at, STALE_HOLD_S)
                if not bus.link.is_closed:
                    log.warning("registry watch of %s silent for %.1fs; starting it over failed: %r",
                                bucket, silent_s, exc)

    async def _stop_watch(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self._watcher is not None:
            await _stop_watcher(self._watcher)
        self._watch_task = self._watcher = None

    async def _follow(self, watcher, copy: dict[str, tuple[WorkerInfo, float]]) -> None:
        async for entry in watcher:
            if entry is not None:
                self._heard_at = time.monotonic()
                self._apply(copy, entry)

    @staticmethod
    def _apply(copy: dict[str, tuple[WorkerInfo, float]], entry) -> None:
        if entry.operation in (KV_DEL, KV_PURGE):
            copy.pop(entry.key, None)
            return
        try:
            info = WorkerInfo.from_bytes(entry.value or b"")
        except ValidationError:
            log.warning("ignoring malformed registry entry %r", entry.key)
            return
        # The server's timestamp of the put: entries replayed at start keep their real age.
        put_at = entry.created.timestamp() if entry.created else time.time()
        copy[entry.key] = (info, put_at)

    async def put(self, info: WorkerInfo) -> None:
        info = info.model_copy(update={"heartbeat_at": time.time()})
        await self._kv.put(info.worker_id, info.to_bytes())

    async def delete(self, worker_id: str) -> None:
        await self._kv.delete(worker_id)

    async def list(self) -> list[WorkerInfo]:
        if self._copy is not None:
            now = time.time()
            if self._stale:  # as of when the watch last heard, for up to STALE_HOLD_S
                now = max(now - (time.monotonic() - self._heard_at), now - STALE_HOLD_S)
            return [info for info, put_at in self._copy.values() if now - put_at <= self.ttl_s]
        workers = []
        for key, value in await self._kv.items():
            try:
                workers.append(WorkerInfo.from_bytes(value))
            except ValidationError:
                log.warning("ignoring malformed registry entry %r", key)
        return workers

    async def heartbeat(self, current: Callable[[], WorkerInfo]) -> None:
        """Put ``current()`` every ``ttl/3`` seconds until cancelled; a failed put is logged and
        retried on the next beat (a NATS reconnect must not kill the worker)."""
        while True:
            try:
                await self.put(current())
            except Exception as exc:  # noqa: BLE001
                log.warning("registry heartbeat failed: %s", exc)
            await asyncio.sleep(self.ttl_s / 3)


async def _stop_watcher(watcher) -> None:
    try:
        await watcher.stop()
    except Exception as exc:  # noqa: BLE001 — connection gone: the server drops the consumer itself
        log.debug("stopping a registry watch: %s", exc)
