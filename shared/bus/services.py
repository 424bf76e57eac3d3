"""The service directory: a NATS KV bucket where every service process (gateway, admission,
kv-index, autoscaler, each worker) keeps its ``ServiceInfo`` — where its metrics are — alive with a
heartbeat, as workers do in the registry. The bucket's TTL drops a process that stops beating."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pydantic import ValidationError

from shared.bus.bus import Bus
from shared.bus.kv import KvBucket
from shared.protocol.workers import ServiceInfo

log = logging.getLogger(__name__)


class ServiceDirectory:
    def __init__(self, kv: KvBucket, ttl_s: float) -> None:
        self._kv = kv
        self.ttl_s = ttl_s

    @classmethod
    async def open(cls, bus: Bus, bucket: str, *, ttl_s: float = 6.0) -> ServiceDirectory:
        """Bind to the bucket, creating it with ``ttl_s`` if it does not exist."""
        kv = await bus.key_value(bucket, ttl_s=ttl_s)
        return cls(kv, await kv.ttl_s() or ttl_s)

    async def put(self, info: ServiceInfo) -> None:
        info = info.model_copy(update={"heartbeat_at": time.time()})
        await self._kv.put(info.instance_id, info.to_bytes())

    async def delete(self, instance_id: str) -> None:
        await self._kv.delete(instance_id)

    async def list(self) -> list[ServiceInfo]:
        """Every live entry, ordered by service then instance."""
        found = []
        for key, value in await self._kv.items():
            try:
                found.append(ServiceInfo.from_bytes(value))
            except ValidationError:
                log.warning("ignoring malformed service entry %r", key)
        return sorted(found, key=lambda s: (s.service, s.instance_id))

    async def heartbeat(self, current: Callable[[], ServiceInfo]) -> None:
        """Put ``current()`` every ``ttl/3`` seconds until cancelled; a failed put is retried on
        the next beat."""
        while True:
            try:
                await self.put(current())
            except Exception as exc:  # noqa: BLE001 — reconnecting: the next beat will do
                log.warning("service directory heartbeat failed: %s", exc)
            await asyncio.sleep(self.ttl_s / 3)
