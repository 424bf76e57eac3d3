"""KV cache metadata on the wire: events from the workers' block pools and index lookups.

Only metadata travels here; KV bytes never go over NATS.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from shared.protocol.base import BlockHash, WireModel, WorkerId


class BlockStoredEvent(WireModel):
    kind: Literal["stored"] = "stored"
    seq: int = Field(ge=1)
    timestamp: float
    block_hashes: list[BlockHash]
    parent_hash: BlockHash | None = None
    tier: str = "gpu"


class BlockRemovedEvent(WireModel):
    kind: Literal["removed"] = "removed"
    seq: int = Field(ge=1)
    timestamp: float
    block_hashes: list[BlockHash]
    tier: str = "gpu"


class AllBlocksClearedEvent(WireModel):
    kind: Literal["cleared"] = "cleared"
    seq: int = Field(ge=1)
    timestamp: float


KvEvent = Annotated[Union[BlockStoredEvent, BlockRemovedEvent, AllBlocksClearedEvent],
                    Field(discriminator="kind")]


class KvEventBatch(WireModel):
    """Consecutive events of one worker; ``seq`` increases by one per event across batches, so the
    index sees a gap when ``events[0].seq`` is not one past the last it applied."""

    worker_id: WorkerId
    events: list[KvEvent] = Field(min_length=1)


class KvMatchRequest(WireModel):
    block_hashes: list[BlockHash]


class WorkerOverlap(WireModel):
    worker_id: WorkerId
    num_blocks: int = Field(ge=1)  # leading blocks of the query the worker holds, in any tier
    num_host_blocks: int = Field(0, ge=0)  # of those, held only in host memory (copied back on use)
    num_disk_blocks: int = Field(0, ge=0)  # held only on disk (read back on use)


class KvMatchResult(WireModel):
    """Per worker, how many leading blocks of the query it holds (workers with none are omitted)."""

    overlaps: list[WorkerOverlap] = Field(default_factory=list)
