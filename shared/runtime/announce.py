"""Service processes (gateway, admission, kv-index, autoscaler) announce themselves in the
``<ns>-services`` KV bucket, whose entries expire unless heartbeated (as the worker registry's):
``tandem status`` lists who runs and how often its supervisor restarted it. Several instances of
one service (``tandem up --admissions 2``) each have their own entry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid

from pydantic import ValidationError

from shared.bus import Bus
from shared.bus.kv import KvBucket
from shared.protocol import ServiceInfo, Subjects

log = logging.getLogger(__name__)


async def open_services(bus: Bus, namespace: str, ttl_s: float) -> KvBucket:
    return await bus.key_value(Subjects(namespace).services_bucket, ttl_s=ttl_s)


def this_service(service: str, num_restarts: int) -> ServiceInfo:
    return ServiceInfo(service=service, instance_id=f"{service}-{uuid.uuid4().hex[:12]}", host=socket.gethostname(),
                       pid=os.getpid(), started_at=time.time(), num_restarts=num_restarts)


async def announce_forever(bucket: KvBucket, info: ServiceInfo, interval_s: float) -> None:
    """Put ``info`` every ``interval_s`` until cancelled, then remove it (a killed process's entry
    expires instead). A failed put is retried at the next beat (NATS reconnecting)."""
    try:
        while True:
            try:
                await bucket.put(info.instance_id, info.model_copy(update={"heartbeat_at": time.time()}).to_bytes())
            except Exception as exc:  # noqa: BLE001
                log.warning("announcing %s failed: %r", info.instance_id, exc)
            await asyncio.sleep(interval_s)
    finally:
        with contextlib.suppress(Exception):
            await bucket.delete(info.instance_id)


async def list_services(bucket: KvBucket) -> list[ServiceInfo]:
    """Every announced service process, by service name then start time."""
    found = []
    for key, value in await bucket.items():
        try:
            found.append(ServiceInfo.from_bytes(value))
        except ValidationError:
            log.warning("ignoring malformed services entry %r", key)
    return sorted(found, key=lambda s: (s.service, s.started_at))
