"""The cluster's compiled decode steps for a worker's engine (``shared.engine.compiled.artifacts``):
an ``ArtifactStore`` over the NATS Object Store bucket ``<ns>-compile``. The engine calls it from
its own threads (the build, the background compile); each call runs on the worker's event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import platform
import time

from shared.bus import Bus
from shared.protocol import Subjects

log = logging.getLogger(__name__)


class NatsArtifactStore:
    def __init__(self, bucket, loop: asyncio.AbstractEventLoop, timeout_s: float = 300.0) -> None:
        self._bucket = bucket
        self._loop = loop
        self._timeout_s = timeout_s
        self.fetched = self.published = 0  # artifacts read from / written to the bucket

    @classmethod
    async def open(cls, bus: Bus, subjects: Subjects) -> "NatsArtifactStore | None":
        """None (logged) if the bucket cannot be reached: the worker then compiles for itself."""
        try:
            bucket = await bus.object_store(subjects.compile_bucket)
        except Exception as exc:  # noqa: BLE001 - without the bucket this worker compiles alone, nothing else
            log.warning("the cluster's compiled decode steps are out of reach (%s): compiling without them", exc)
            return None
        return cls(bucket, asyncio.get_running_loop())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self._timeout_s)

    def get(self, key: str) -> bytes | None:
        data = self._run(self._bucket.get(key))
        self.fetched += data is not None
        return data

    def has(self, key: str) -> bool:
        return self._run(self._bucket.info(key)) is not None

    def put(self, key: str, data: bytes) -> None:
        description = json.dumps({"key": key, "host": platform.node(), "at": time.time()})
        self._run(self._bucket.put(key, data, description))
        self.published += 1
