"""The worker registry: a NATS KV bucket whose entries expire unless heartbeated.

A worker puts its ``WorkerInfo`` under its id every ``ttl/3`` seconds; the bucket's ``ttl``
(JetStream ``max_age``) removes the entry of a worker that stops heartbeating (killed, hung,
partitioned) without anyone having to notice. Readers list the bucket; they never cache an entry
longer than one listing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import nats.js.errors
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue
from pydantic import ValidationError

from shared.bus.bus import Bus
from shared.protocol.workers import WorkerInfo

log = logging.getLogger(__name__)


class WorkerRegistry:
    def __init__(self, kv: KeyValue, ttl_s: float) -> None:
        self._kv = kv
        self.ttl_s = ttl_s

    @classmethod
    async def open(cls, bus: Bus, bucket: str, *, ttl_s: float = 6.0) -> "WorkerRegistry":
        """Bind to the bucket, creating it with ``ttl_s`` if it does not exist (an existing
        bucket keeps the TTL it was created with)."""
        try:
            kv = await bus.js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            try:
                kv = await bus.js.create_key_value(KeyValueConfig(bucket=bucket, ttl=ttl_s, history=1))
            except nats.js.errors.BadRequestError:  # created concurrently by another process
                kv = await bus.js.key_value(bucket)
        status = await kv.status()
        return cls(kv, status.ttl or ttl_s)

    async def put(self, info: WorkerInfo) -> None:
        info = info.model_copy(update={"heartbeat_at": time.time()})
        await self._kv.put(info.worker_id, info.to_bytes())

    async def delete(self, worker_id: str) -> None:
        try:
            await self._kv.purge(worker_id)
        except nats.js.errors.KeyNotFoundError:
            pass

    async def list(self) -> list[WorkerInfo]:
        try:
            keys = await self._kv.keys()
        except nats.js.errors.NoKeysError:
            return []
        workers = []
        for key in keys:
            try:
                entry = await self._kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                continue  # expired or deleted between keys() and get()
            try:
                workers.append(WorkerInfo.from_bytes(entry.value or b""))
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
