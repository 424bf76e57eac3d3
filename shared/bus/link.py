"""The NATS connection's losses and returns, as the rest of ``shared/bus`` needs them.

nats-py reconnects on its own and replays core subscriptions, but two things it cannot mend:

- A streamed reply open across a disconnect may have lost messages (the server dropped what was
  published to the reply subject while the subscription was gone). The stream must end with an
  error instead of going on with a gap, or waiting for an end marker that will never come:
  ``on_loss`` tells it.
- Ephemeral JetStream consumers (stream replays, KV watchers) can die with the server, or come back
  at a state that no longer matches ours. ``on_resume`` hooks re-create them after a reconnect; a
  hook that fails (JetStream still restoring) is retried with backoff until it succeeds, the
  connection closes, or the next reconnect starts it over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from shared.bus.backoff import Backoff

log = logging.getLogger(__name__)

_RESUME_BACKOFF = Backoff(initial_s=0.1, factor=2.0, max_s=2.0)


class Link:
    def __init__(self, name: str) -> None:
        self.name = name
        self.num_disconnects = 0
        self._loss_listeners: set[Callable[[], None]] = set()
        self._resumers: dict[str, Callable[[], Awaitable[None]]] = {}
        self._resuming: dict[str, asyncio.Task] = {}
        self.is_closed = False

    def on_loss(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` (synchronously) at the next disconnect; returns the function that
        stops listening."""
        self._loss_listeners.add(listener)
        return lambda: self._loss_listeners.discard(listener)

    def on_resume(self, key: str, resume: Callable[[], Awaitable[None]]) -> Callable[[], None]:
        """Run ``resume`` after every reconnect (replacing an earlier hook under ``key``); returns
        the function that removes it."""
        self._resumers[key] = resume

        def remove() -> None:
            if self._resumers.get(key) is resume:
                del self._resumers[key]
            if task := self._resuming.pop(key, None):
                task.cancel()

        return remove

    def disconnected(self) -> None:
        self.num_disconnects += 1
        for task in self._resuming.values():  # a resume in progress is started over at the reconnect
            task.cancel()
        self._resuming.clear()
        listeners, self._loss_listeners = self._loss_listeners, set()
        for listener in listeners:
            listener()

    def reconnected(self) -> None:
        for key, resume in self._resumers.items():
            if old := self._resuming.get(key):
                old.cancel()
            self._resuming[key] = asyncio.create_task(self._retry(key, resume))

    async def _retry(self, key: str, resume: Callable[[], Awaitable[None]]) -> None:
        for delay in _RESUME_BACKOFF.delays():
            if self.is_closed:
                return
            try:
                await resume()
                log.info("nats %s: %s resumed", self.name, key)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — e.g. JetStream not restored yet: try again
                log.warning("nats %s: resuming %s failed (%r); retrying in %.1fs", self.name, key, exc, delay)
            await asyncio.sleep(delay)

    def close(self) -> None:
        self.is_closed = True
        for task in self._resuming.values():
            task.cancel()
        self._resuming.clear()
        self._resumers.clear()
