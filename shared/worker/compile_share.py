"""A worker's side of the cluster's compile artifacts (``shared.engine.compile_artifacts``): before
its engine is built, point inductor at the key's directory and fill it from NATS if this machine
has not compiled that key; once its own compile has finished, publish what it built if the cluster
has nothing under the key yet."""

from __future__ import annotations

import asyncio
import logging

from shared.bus import Bus
from shared.engine.compile_artifacts import CompileArtifacts, engine_artifact_key, fetch_from, publish_to
from shared.protocol import Subjects

log = logging.getLogger(__name__)

POLL_S = 2.0


class SharedCompile:
    def __init__(self, artifacts: CompileArtifacts, bucket, source: str) -> None:
        self.artifacts = artifacts
        self._bucket = bucket
        self.source = source  # "local" (this machine's cache), "cluster" (fetched) or "cold"

    @classmethod
    async def prepare(cls, config, bus: Bus, subjects: Subjects) -> "SharedCompile | None":
        """None where the engine will not compile (``compile`` off, or not on a CPU)."""
        if config.compile == "off" or config.resolve_device().type != "cpu":
            return None
        key = await asyncio.to_thread(engine_artifact_key, config)
        artifacts = CompileArtifacts(CompileArtifacts.default_root(), key)
        artifacts.activate()
        try:
            bucket = await bus.object_store(subjects.compile_bucket)
        except Exception as exc:  # noqa: BLE001 - without the bucket this worker compiles alone, nothing else
            log.warning("the cluster's compile artifacts are out of reach (%s): compiling without them", exc)
            bucket = None
        if (done := artifacts.complete()) is not None:
            log.info("compile artifacts %s are on this machine already (%s): the decode step compiles from them",
                     key, done.get("source"))
            return cls(artifacts, bucket, "local")
        fetched = bucket is not None and await fetch_from(bucket, artifacts)
        return cls(artifacts, bucket, "cluster" if fetched else "cold")

    async def publish_when_compiled(self, engine) -> bool:
        """Wait for the engine's compile (``engine`` an ``AsyncEngine``); then mark this machine's
        artifacts complete and publish them unless the cluster has them. True if published."""
        background = engine.engine.background_compile
        while background is not None and not background.done.is_set():
            await asyncio.sleep(POLL_S)
        if engine.engine.runner.compiled is None:  # the compile failed (logged by it): nothing to share
            return False
        if self.artifacts.complete() is None:
            self.artifacts.mark_complete("compiled")
        if self._bucket is None:
            return False
        try:
            return await publish_to(self._bucket, self.artifacts)
        except Exception as exc:  # noqa: BLE001 - the next worker compiles cold, nothing else is lost
            log.warning("publishing compile artifacts %s failed: %s", self.artifacts.key, exc)
            return False
