"""KV cache events: what the block pool tells the outside world (the kv-index service).

Events are plain dataclasses (no wire types here: services translate them). Every event gets a
monotonic ``seq`` from the pool's emitter so a consumer can detect gaps and replay.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, Union


@dataclass(frozen=True)
class BlockStored:
    """Full blocks became cached. ``block_hashes[i]`` has parent ``block_hashes[i-1]``;
    the first one's parent is ``parent_hash`` (None when it is a prompt's first block)."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: str = "gpu"


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks were evicted and their content is gone."""

    block_hashes: tuple[int, ...]
    tier: str = "gpu"


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole cache was reset."""


KvCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class SequencedEvent:
    seq: int
    timestamp: float
    event: KvCacheEvent


class KvEventSink(Protocol):
    def emit(self, event: SequencedEvent) -> None:
        """Called synchronously from the engine thread; must not block (queue and return)."""


@dataclass
class KvEventEmitter:
    """Numbers events and hands them to the sinks. ``seq`` starts at 1 and never repeats."""

    sinks: list[KvEventSink] = field(default_factory=list)
    _seq: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def emit(self, event: KvCacheEvent) -> None:
        if not self.sinks:
            return
        with self._lock:
            self._seq += 1
            seq_event = SequencedEvent(self._seq, time.time(), event)
        for sink in self.sinks:
            sink.emit(seq_event)

    def add_sink(self, sink: KvEventSink) -> None:
        self.sinks.append(sink)


class ListSink:
    """Collects events in memory (tests, the in-process CLI)."""

    def __init__(self) -> None:
        self.events: list[SequencedEvent] = []

    def emit(self, event: SequencedEvent) -> None:
        self.events.append(event)

