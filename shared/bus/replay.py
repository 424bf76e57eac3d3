"""An ordered delivery of a JetStream stream's messages to one handler (``Bus.replay``) that
survives NATS restarts and can be started over.

It rides on an ephemeral ordered consumer. After a reconnect the server may have lost that
consumer, or kept it at a position of its own; so the replay subscribes again right after the last
message it delivered, and skips anything at or before it (the old consumer's stragglers). One
handler call runs at a time, in stream order, across re-subscriptions; so the handler must not call
``start``, ``resume`` or ``stop`` itself (they wait for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from pydantic import ValidationError

from shared.protocol.base import WireModel
from shared.protocol.subjects import Endpoint

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=WireModel)


class Replay(Generic[Req]):
    def __init__(self, js: JetStreamContext, endpoint: Endpoint[Req, WireModel], stream: str,
                 handler: Callable[[Req, int], Awaitable[None]], on_handler_error: Callable[[], None]) -> None:
        self._js = js
        self._endpoint = endpoint
        self._stream = stream
        self._handler = handler
        self._on_handler_error = on_handler_error
        self._lock = asyncio.Lock()
        self._sub = None
        self._generation = 0   # which subscription's messages count; older ones' are dropped
        self._start_seq = 0
        self.last_seq = 0      # stream seq of the last message delivered (handled or skipped)
        self._stream_created = None  # the stream's creation time: a new one is another stream

    async def start(self, start_seq: int = 0) -> None:
        """Deliver from ``start_seq`` (0: the first message still stored), forgetting what was
        delivered before: a replay started over."""
        async with self._lock:
            self._start_seq, self.last_seq = start_seq, max(start_seq - 1, 0)
            self._stream_created = (await self._js.stream_info(self._stream)).created
            await self._subscribe(start_seq)

    async def resume(self) -> None:
        """Subscribe again right after the last message delivered (after a reconnect). A stream
        created anew meanwhile (the server lost its store) is delivered from its start."""
        async with self._lock:
            info = await self._js.stream_info(self._stream)
            if info.created != self._stream_created or info.state.last_seq < self.last_seq:
                log.warning("stream %s was created anew (the server lost its store): delivering it "
                            "from its start", self._stream)
                self._start_seq = self.last_seq = 0
                self._stream_created = info.created
            await self._subscribe(self.last_seq + 1 if self.last_seq else self._start_seq)

    async def _subscribe(self, start_seq: int) -> None:
        await self._unsubscribe()
        self._generation += 1
        generation = self._generation

        async def on_msg(msg: Msg) -> None:
            async with self._lock:
                if generation == self._generation:
                    await self._deliver(msg)

        config = (ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq)
                  if start_seq > 0 else ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        self._sub = await self._js.subscribe(self._endpoint.subject, stream=self._stream, cb=on_msg,
                                             ordered_consumer=True, config=config)

    async def _deliver(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.last_seq:  # delivered already, by an earlier subscription
            return
        self.last_seq = seq
        try:
            item = self._endpoint.request_type.from_bytes(msg.data)
        except ValidationError as exc:
            log.warning("skipping bad message %s on %s: %s", seq, msg.subject, exc.errors()[0]["msg"])
            return
        try:
            await self._handler(item, seq)
        except Exception:  # noqa: BLE001 — one bad message must not stop the replay
            self._on_handler_error()
            log.exception("handler for %s failed", msg.subject)

    async def _unsubscribe(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):  # connection gone: nothing to undo
                await self._sub.unsubscribe()
            self._sub = None

    async def stop(self) -> None:
        async with self._lock:
            self._generation += 1
            await self._unsubscribe()
