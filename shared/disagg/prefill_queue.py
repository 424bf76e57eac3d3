"""The prefill queue as a prefill worker pulls it: one work queue per priority level, served by
``shared.policy.prefill_queue.LevelPicker`` (strict priority, bounded starvation)."""

from __future__ import annotations

import logging

from shared.bus import Bus, ConsumerState, QueueMessage, WorkQueue
from shared.policy.prefill_queue import LevelPicker
from shared.protocol import RemotePrefillRequest, Subjects
from shared.protocol.subjects import NUM_PREFILL_LEVELS

log = logging.getLogger(__name__)

_TAKE_TIMEOUT_S = 0.05   # a level that said it had messages answers at once
_IDLE_WAIT_S = 0.2       # nothing waits anywhere: long-poll the top level this long, then look again


async def prefill_queue_levels(bus: Bus, subjects: Subjects) -> list[ConsumerState] | None:
    """Every priority level's consumer state, highest priority first; None if a level's consumer
    (or the stream) does not exist. NATS failures raise."""
    states = [await bus.consumer_info(subjects.prefill_stream, name) for name in subjects.prefill_consumers()]
    return None if None in states else states


class PrefillQueues:
    def __init__(self, bus: Bus, subjects: Subjects, queues: list[WorkQueue[RemotePrefillRequest]],
                 picker: LevelPicker) -> None:
        self._bus = bus
        self._subjects = subjects
        self._queues = queues
        self._picker = picker

    @classmethod
    async def open(cls, bus: Bus, subjects: Subjects, *, ack_wait_s: float, max_deliver: int,
                   max_skips: int) -> "PrefillQueues":
        """Bind every level's durable consumer (the stream must exist)."""
        queues = [await bus.pull_consumer(subjects.prefill_queue(level), subjects.prefill_stream,
                                          subjects.prefill_consumer(level), ack_wait_s=ack_wait_s,
                                          max_deliver=max_deliver)
                  for level in range(NUM_PREFILL_LEVELS)]
        return cls(bus, subjects, queues, LevelPicker(NUM_PREFILL_LEVELS, max_skips))

    async def pending(self) -> list[int]:
        """Messages waiting (not yet delivered) at each level, highest priority first."""
        states = await prefill_queue_levels(self._bus, self._subjects)
        return [s.num_pending for s in states] if states else [0] * NUM_PREFILL_LEVELS

    async def fetch(self, free: int) -> list[QueueMessage[RemotePrefillRequest]]:
        """Up to ``free`` messages, one pick at a time. When no level has anything waiting, waits
        up to a fraction of a second on the top level and returns what came (maybe nothing)."""
        pending = await self.pending()
        msgs: list[QueueMessage[RemotePrefillRequest]] = []
        while len(msgs) < free and (level := self._picker.pick(pending)) is not None:
            got = await self._queues[level].fetch(1, timeout_s=_TAKE_TIMEOUT_S)
            pending[level] = pending[level] - 1 if got else 0  # another worker may have taken it
            msgs += got
        if not msgs and not any(pending):
            msgs = await self._queues[0].fetch(free, timeout_s=_IDLE_WAIT_S)
        return msgs

    async def close(self) -> None:
        for queue in self._queues:
            try:  # a pull subscription left with a cancelled fetch would hold up the connection's drain
                await queue.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("leaving the prefill queue: %s", exc)
