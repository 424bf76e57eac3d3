"""JetStream types of our own, so no nats object leaves ``shared/bus``: a pulled work-queue
message with its acknowledgements, the pull consumer that fetches them, and the few numbers of a
stream's and a consumer's state that callers read."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Generic, TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import ConsumerInfo, StreamInfo
from pydantic import ValidationError

from shared.protocol.base import WireModel
from shared.protocol.subjects import Endpoint

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=WireModel)


@dataclass(frozen=True)
class StreamState:
    num_msgs: int
    first_seq: int
    last_seq: int

    @classmethod
    def of(cls, info: StreamInfo) -> "StreamState":
        return cls(num_msgs=info.state.messages, first_seq=info.state.first_seq, last_seq=info.state.last_seq)


@dataclass(frozen=True)
class ConsumerState:
    num_pending: int        # in the stream, not yet delivered to anyone
    num_ack_pending: int    # delivered, not yet acknowledged
    num_redelivered: int    # delivered more than once and not yet acknowledged
    num_waiting: int        # pull requests waiting for messages

    @classmethod
    def of(cls, info: ConsumerInfo) -> "ConsumerState":
        return cls(num_pending=info.num_pending or 0, num_ack_pending=info.num_ack_pending or 0,
                   num_redelivered=info.num_redelivered or 0, num_waiting=info.num_waiting or 0)


class QueueMessage(Generic[Req]):
    """One message pulled from a work queue, its payload decoded. Settle it exactly once with
    ``ack`` (done), ``nak`` (redeliver now) or ``term`` (never redeliver); ``in_progress`` while
    working restarts the consumer's ack wait."""

    def __init__(self, msg: Msg, payload: Req) -> None:
        self._msg = msg
        self.payload = payload
        self.num_delivered: int = msg.metadata.num_delivered  # 1 on the first delivery
        self.stream_seq: int = msg.metadata.sequence.stream
        self.headers: dict[str, str] = dict(msg.headers or {})  # e.g. the publisher's trace context
        # when the stream stored it: epoch seconds by the server's clock
        self.published_at: float = msg.metadata.timestamp.timestamp()

    async def ack(self) -> None:
        await self._msg.ack()

    async def nak(self) -> None:
        await self._msg.nak()

    async def term(self) -> None:
        await self._msg.term()

    async def in_progress(self) -> None:
        await self._msg.in_progress()


class WorkQueue(Generic[Req]):
    """A durable pull consumer bound to one endpoint (``Bus.pull_consumer``)."""

    def __init__(self, endpoint: Endpoint[Req, WireModel], sub) -> None:
        self._endpoint = endpoint
        self._sub = sub

    async def fetch(self, batch: int, *, timeout_s: float) -> list[QueueMessage[Req]]:
        """Up to ``batch`` messages, waiting up to ``timeout_s`` for the first; [] if none came.
        A malformed message is terminated (it would fail on every redelivery) and not returned;
        other failures (NATS reconnecting) raise."""
        try:
            msgs = await self._sub.fetch(batch=batch, timeout=timeout_s)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return []
        decoded = []
        for msg in msgs:
            try:
                decoded.append(QueueMessage(msg, self._endpoint.request_type.from_bytes(msg.data)))
            except ValidationError as exc:
                log.warning("dropping a malformed message on %s: %s", msg.subject, exc.errors()[0]["msg"])
                await self._term(msg)
        return decoded

    @staticmethod
    async def _term(msg: Msg) -> None:
        try:
            await msg.term()
        except Exception as exc:  # noqa: BLE001 — the other messages of the batch still count
            log.warning("could not terminate a malformed message (it comes back to fail again): %s", exc)

    async def close(self) -> None:
        """Stop pulling (unacknowledged messages go to other consumers after their ack wait)."""
        await self._sub.unsubscribe()
