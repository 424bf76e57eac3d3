"""The decode worker's I/O for disaggregated prefill around ``shared.disagg.RemotePrefills``:
read what the policy needs (prefill workers in the registry, the prefill queue's length), publish
the reserved request on the JetStream prefill queue, poll the KV transfer's notifications and
tick the core's clock."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from shared.bus import Bus, WorkerRegistry
from shared.cluster.workers import is_ready_worker
from shared.disagg import RemotePrefill, RemotePrefills
from shared.disagg.prefill_queue import prefill_queue_levels
from shared.engine import EngineOutput, SamplingParams
from shared.policy.disagg import DisaggConfig
from shared.protocol import GenerateRequest, PrefillLeaseRequest, PrefillLeaseResult, Subjects
from shared.transfer import KvTransfer

log = logging.getLogger(__name__)


class RemotePrefiller:
    def __init__(self, prefills: RemotePrefills, *, bus: Bus, registry: WorkerRegistry, transfer: KvTransfer,
                 subjects: Subjects) -> None:
        self.prefills = prefills
        self.transfer = transfer
        self._bus = bus
        self._registry = registry
        self._subjects = subjects
        self._num_absent = 0  # rounds of check_prefill_workers in a row without a prefill worker

    async def start(self, request: GenerateRequest, params: SamplingParams) -> RemotePrefill | None:
        """Reserve and publish a remote prefill if the policy says so; None: prefill locally. A
        failed publish still returns the reservation, resolved at once: it prefills locally."""
        prefills, now = self.prefills, time.time()
        if not prefills.may_go_remote(len(request.prompt_token_ids), now):
            return None
        has_prefill_workers = await self._has_prefill_workers()
        if has_prefill_workers and prefills.needs_queue_state(now):
            prefills.observe_queue(now, await self._queue_length())
        prefill = await prefills.reserve(request, params, now=now, has_prefill_workers=has_prefill_workers)
        if prefill is None:
            return None
        try:
            await self._bus.js_publish(self._subjects.prefill_queue(request.priority), prefill.message)
            prefill.published_at = time.monotonic()
        except Exception as exc:  # noqa: BLE001 — a full queue, NATS away: prefill here, now
            prefills.publish_failed(prefill, exc)
        return prefill

    def may_go_remote(self, num_prompt_tokens: int) -> bool:
        """Whether a prompt this long could be prefilled remotely now (``RemotePrefills.may_go_remote``)."""
        return self.prefills.may_go_remote(num_prompt_tokens, time.time())

    def outputs(self, prefill: RemotePrefill) -> AsyncIterator[EngineOutput]:
        """The tokens of a request ``start`` reserved (``RemotePrefills.outputs``)."""
        return self.prefills.outputs(prefill)

    def cancel(self, request_id: str) -> None:
        """The client went away: stop waiting for the request's KV (``RemotePrefills.cancel``)."""
        self.prefills.cancel(request_id)

    # -- the thresholds and counters the decode worker reports -------------------------------------
    @property
    def config(self) -> DisaggConfig:
        return self.prefills.config

    def configure(self, **changes) -> DisaggConfig:
        """Replace the named ``DisaggConfig`` fields (a ``configure`` control request); the new config."""
        self.prefills.config = dataclasses.replace(self.prefills.config, **changes)
        return self.prefills.config

    @property
    def num_remote(self) -> int:
        return self.prefills.num_remote

    @property
    def num_fallbacks(self) -> int:
        return self.prefills.num_fallbacks

    async def grant_lease(self, request: PrefillLeaseRequest) -> PrefillLeaseResult:
        return self.prefills.grant_lease(request, time.time())

    async def check_prefill_workers(self) -> None:
        """One round of the decode worker's check (``every`` second): while requests wait for a
        remote prefill and no prefill worker has been listed at two rounds in a row, the waits
        nobody leased end (``RemotePrefills.no_prefill_workers``) rather than run out their windows."""
        if not self.prefills.has_waiting:
            self._num_absent = 0
            return
        self._num_absent = 0 if await self._has_prefill_workers() else self._num_absent + 1
        if self._num_absent >= 2:
            self.prefills.no_prefill_workers()

    async def _has_prefill_workers(self) -> bool:
        return any(is_ready_worker(w, "prefill", self.prefills.model) for w in await self._registry.list())

    async def _queue_length(self) -> int | None:
        """Requests waiting in the prefill queue, all priority levels (not yet taken by a worker);
        None: no queue."""
        try:
            levels = await prefill_queue_levels(self._bus, self._subjects)
        except Exception as exc:  # noqa: BLE001 — NATS reconnecting: prefill locally meanwhile
            log.warning("prefill queue state unavailable (%s): prefilling locally", exc)
            return None
        return None if levels is None else sum(level.num_pending for level in levels)

    # -- as a receiver of the KV transfer's notifications (``poll_kv_forever``) -------------------
    def deliver(self, message: bytes, num_bytes: int, received_at: float) -> bool:
        self.prefills.deliver(message, num_bytes, received_at)
        return True

    @property
    def has_waiting(self) -> bool:
        return self.prefills.has_waiting

    def tick(self, now: float) -> None:
        self.prefills.tick(now)

    async def poll_forever(self) -> None:
        await poll_kv_forever(self.transfer, [self])


class NotificationReceiver(Protocol):
    has_waiting: bool

    def deliver(self, message: bytes, num_bytes: int, received_at: float) -> bool:
        """Take a notification (True), or leave it to the next receiver (False)."""

    def tick(self, now: float) -> None:
        """Time passed (``now``: epoch seconds): end waits that ran out."""


async def poll_kv_forever(transfer: KvTransfer, receivers: Sequence[NotificationReceiver]) -> None:
    """Drain the transfer's notifications, each to the first receiver that takes it, and tick them:
    often while one waits for KV, rarely otherwise (the calls also drive the backend's progress,
    e.g. accepting a new writer's connection)."""
    while True:
        delay = 0.002 if any(r.has_waiting for r in receivers) else 0.05
        try:
            for note in transfer.get_notifications():
                at = time.monotonic()
                if not any(r.deliver(note.message, note.num_bytes, at) for r in receivers):
                    log.debug("KV notification from %s that nobody waits for ignored", note.peer)
        except Exception:  # noqa: BLE001 — the ticks below must go on: they end the waits
            log.exception("polling KV notifications failed")
            delay = 0.5
        now = time.time()
        for receiver in receivers:
            receiver.tick(now)
        await asyncio.sleep(delay)
