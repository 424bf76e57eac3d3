"""The only code that talks to NATS: connect, request/reply, streamed replies, serving with one
error wrapper per handler, JetStream streams.

Every handler runs in its own task, so one slow request never holds up a subscription, and the
wrapper turns any failure into an error reply: a malformed message gets ``bad_request``, a
``ServiceError`` its own code, anything else ``internal`` plus a logged traceback. The
subscription keeps running in every case.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import (AckPolicy, ConsumerConfig, DiscardPolicy, KeyValueConfig, ObjectStoreConfig,
                         RetentionPolicy, StreamConfig)
from pydantic import ValidationError

from shared.bus.backoff import Backoff
from shared.bus.errors import (BusTimeout, Disconnected, MalformedReply, NatsCredentialsRefused, NatsTlsFailed,
                               NatsUnavailable, NatsUnreachable, NoResponders, RemoteError, ServiceError)
from shared.bus.jetstream import ConsumerState, StreamState, WorkQueue
from shared.bus.kv import KvBucket
from shared.bus.link import Link
from shared.bus.objects import ObjectBucket
from shared.bus.replay import Replay
from shared.process_settings import process_settings
from shared.protocol.base import WireModel, validation_message
from shared.protocol.errors import ErrorReply
from shared.protocol.subjects import Endpoint
from shared.telemetry import tracing
from shared.telemetry.logs import bind_request_id
from shared.telemetry.redact import redact_url

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=WireModel)
Rep = TypeVar("Rep", bound=WireModel)
T = TypeVar("T")

ERROR_HEADER = "Tandem-Error-Code"
STREAM_HEADER = "Tandem-Stream"  # "end" on the empty message that closes a streamed reply
_STATUS = "Status"
_PING_INTERVAL_S = 5.0
_CONNECT_BACKOFF = Backoff(initial_s=0.05, factor=2.0, max_s=2.0)  # between tries of the first connection


def _error_from_msg(msg: Msg, subject: str) -> ServiceError | None:
    headers = msg.headers or {}
    if headers.get(_STATUS) == "503":
        return NoResponders(subject)
    if ERROR_HEADER not in headers:
        return None
    try:
        body = ErrorReply.from_bytes(msg.data)
        return RemoteError(body.code, body.message, body.field)
    except ValidationError:
        return RemoteError("internal", msg.data.decode(errors="replace")[:500])


def server_urls(url: str) -> list[str]:
    """The servers of a NATS URL setting: one URL, or several separated by commas (the members of a
    cluster; the client connects to one and fails over to the others)."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise ValueError("no NATS server URL given")
    return urls


def tls_context(ca_file: str | None) -> ssl.SSLContext | None:
    """A client TLS context that trusts ``ca_file`` (e.g. the CA ``tandem up --nats-tls`` made)
    and checks the server's name against it; None without a CA file."""
    if not ca_file:
        return None
    return ssl.create_default_context(cafile=ca_file)


def detect_replicas(server_info: dict) -> int:
    """How many copies JetStream should keep of our streams and buckets: 1 on a single server; on a
    cluster one per member up to 3 (what NATS recommends: a majority survives one member lost).
    The members are the client URLs the server gossips (``connect_urls``, itself included)."""
    if not server_info.get("cluster"):
        return 1
    return max(1, min(3, len(set(server_info.get("connect_urls") or [])) or 1))


def _is_auth_error(exc: BaseException) -> bool:
    # nats-py raises a plain nats.errors.Error carrying the server's -ERR text on the first connection
    return (isinstance(exc, nats.errors.AuthorizationError)
            or "authorization violation" in str(exc).lower())


_AUTH_GRACE_S = 5.0  # reconnects refused for this long: the password changed (not one server's hiccup)


def _credentials(servers: list[str]) -> dict[str, str]:
    """``user`` and ``password`` for nats.connect from the first server URL that carries them."""
    from urllib.parse import unquote, urlparse

    for server in servers:
        uri = urlparse(server)
        if uri.username and uri.password:
            return {"user": unquote(uri.username), "password": unquote(uri.password)}
    return {}


_TRANSIENT_TLS = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)  # a server going away


def _lasting_error(exc: BaseException, shown: str) -> NatsUnavailable | None:
    """The one-line error to stop with when ``exc`` is one that retrying cannot mend (a refused
    login, a certificate our CA did not sign); None when another try may succeed."""
    if _is_auth_error(exc):
        return NatsCredentialsRefused(
            f"NATS at {shown} rejected the credentials: {exc}; on a joined host copy connect.env from the "
            "control plane again (tandem up keeps its password across restarts unless its state directory is wiped)")
    if isinstance(exc, ssl.SSLError) and not isinstance(exc, _TRANSIENT_TLS):
        return NatsTlsFailed(f"TLS with NATS at {shown} failed: {exc}; is the CA file the control plane's "
                             "(its state directory's tls/ca.pem) and the URL's host one its certificate names?")
    return None


def _exit_now(exc: NatsUnavailable) -> None:
    """End the process with ``exc``'s line and exit code. For a login refused on a reconnect:
    nats-py would retry it forever while everything this process serves waits on the bus, and
    its supervisor (tandem join, systemd) sees an exit, not a log."""
    log.error("%s", exc)
    logging.shutdown()  # flush every handler: os._exit skips it
    os._exit(exc.exit_code)


async def _first_connection(connecting: Awaitable[Client], given_up: asyncio.Event, *,
                            timeout_s: float) -> Client:
    """The client ``connecting`` makes, unless ``given_up`` is set first: nats-py retries a refused
    login or a bad certificate forever, telling only its error callback (which sets it)."""
    connect = asyncio.ensure_future(connecting)
    giving_up = asyncio.ensure_future(given_up.wait())
    try:
        done, _ = await asyncio.wait({connect, giving_up}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        giving_up.cancel()
    if connect in done:
        return connect.result()
    connect.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await connect
    raise asyncio.TimeoutError


class _ConnectionEvents:
    """nats-py's callbacks for one connection, and what they saw of the first connection's tries."""

    def __init__(self, name: str, shown: str) -> None:
        self.name = name
        self.shown = shown  # the URL, its password redacted
        self.link = Link(name)
        # once connected, errors are logged (nats-py retries them); logins refused for _AUTH_GRACE_S end the process
        self.connected = False
        self.given_up = asyncio.Event()  # set on an error retrying cannot mend
        self.lasting: NatsUnavailable | None = None  # that error, once seen
        self.last_error: Exception | None = None
        self.refused_since: float | None = None  # when reconnects began to be refused (none since the last success)

    async def on_error(self, exc: Exception) -> None:
        if not self.connected:  # reported once, by the error connect raises
            if not self.given_up.is_set():  # the server hanging up after a refusal says nothing new
                self.last_error = exc
                if error := _lasting_error(exc, self.shown):
                    self.lasting = error
                    self.given_up.set()
            return
        if _is_auth_error(exc):
            if self.refused_since is None:
                self.refused_since = time.monotonic()
            if time.monotonic() - self.refused_since >= _AUTH_GRACE_S:
                _exit_now(_lasting_error(exc, self.shown))
        log.warning("nats %s: %s", self.name, exc)

    async def on_disconnect(self) -> None:
        if self.link.is_closed:  # our own close()
            return
        log.warning("nats %s: disconnected from %s", self.name, self.shown)
        self.link.disconnected()

    async def on_reconnect(self) -> None:
        self.refused_since = None
        log.info("nats %s: reconnected", self.name)
        self.link.reconnected()


def _connect_options(servers: list[str], events: _ConnectionEvents, tls: ssl.SSLContext | None) -> dict:
    """nats.connect's arguments: reconnect forever, every 0.5 s, to any server of the pool."""
    # a server that vanished without closing the connection (its host gone, a cut link) is given
    # up after 3 unanswered pings, 5 s apart, for another member
    return dict(servers=servers, name=events.name, connect_timeout=2, allow_reconnect=True,
                max_reconnect_attempts=-1, reconnect_time_wait=0.5, tls=tls,
                ping_interval=_PING_INTERVAL_S, max_outstanding_pings=3,
                error_cb=events.on_error, disconnected_cb=events.on_disconnect,
                reconnected_cb=events.on_reconnect, **_credentials(servers))


async def _connect_with_retries(options: dict, events: _ConnectionEvents, timeout_s: float) -> Client:
    """The first connection, tried with exponential backoff until ``timeout_s``: see ``Bus.connect``."""
    delays, deadline = _CONNECT_BACKOFF.delays(), time.monotonic() + timeout_s
    while True:
        try:
            # nats-py itself retries an unreachable server forever (reconnects are unlimited):
            # the deadline bounds the first connection
            nc = await _first_connection(nats.connect(**options), events.given_up,
                                         timeout_s=max(deadline - time.monotonic(), 0.1))
            events.connected = True
            return nc
        except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
            if error := (events.lasting or _lasting_error(exc, events.shown)):
                raise error from None
            delay = next(delays)
            if time.monotonic() + delay > deadline:
                why = exc if str(exc) else (events.last_error or "timed out")
                raise NatsUnreachable(f"cannot reach NATS at {events.shown} within {timeout_s:g}s: {why}") from None
            await asyncio.sleep(delay)


class Bus:
    """A NATS connection plus the handler tasks it runs. Create with ``await Bus.connect(...)``."""

    def __init__(self, nc: Client, name: str, link: Link | None = None, *, replicas: int = 1) -> None:
        self.nc = nc
        self.replicas = replicas  # copies of each stream and bucket this bus creates
        self.js = nc.jetstream()
        self.name = name
        self.link = link or Link(name)  # what connect's callbacks report: disconnects, reconnects
        self.num_handler_errors = 0
        self._served: list[Subscription] = []
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    async def connect(cls, url: str, name: str, *, timeout_s: float = 30.0, tls_ca: str | None = None,
                      replicas: int | None = None) -> "Bus":
        """Connect, retrying with exponential backoff for up to ``timeout_s``; afterwards nats-py
        reconnects forever, every 0.5 s, to any server of ``url`` (several, comma-separated: a
        cluster; a server that dies is left for another; a server restart is survived: nats-py replays the core
        subscriptions, the bus's ``link`` ends streams cut by the disconnect and re-creates
        JetStream consumers, streams and buckets the server lost).

        Failing, it raises a one-line ``NatsUnavailable`` (a ConnectionError) naming the URL, its
        password redacted: ``NatsCredentialsRefused`` and ``NatsTlsFailed`` at once (retrying
        cannot mend a wrong password or CA), ``NatsUnreachable`` at the deadline. A login refused
        on a later reconnect (the server's password changed) ends the process at once with
        ``NatsCredentialsRefused``'s line and exit code once every try for ``_AUTH_GRACE_S`` was
        refused: see ``_exit_now``. The URL's user and password are given to every server of the
        pool, those the cluster gossips too (nats-py adds them without the credentials of the URL,
        and a reconnect to one of them was refused after a member died).

        ``tls_ca`` (default: ``TANDEM_NATS_CA``): a CA file; the connection is then TLS and the
        server's certificate must be signed by it for the host name in the URL. ``replicas``
        (default: ``TANDEM_NATS_REPLICAS``, else detected from the server): copies JetStream keeps
        of each stream and bucket this bus creates."""
        servers = server_urls(url)
        settings = process_settings()
        events = _ConnectionEvents(name, redact_url(url))
        options = _connect_options(servers, events, tls_context(tls_ca or settings.nats_ca))
        nc = await _connect_with_retries(options, events, timeout_s)
        replicas = replicas or settings.nats_replicas or detect_replicas(nc._server_info)
        return cls(nc, name, events.link, replicas=replicas)

    # --- caller side ------------------------------------------------------------------------------
    async def request(self, endpoint: Endpoint[Req, Rep], payload: Req, *, timeout_s: float) -> Rep:
        assert endpoint.reply_type is not None, f"{endpoint.subject} is publish-only"
        try:
            with tracing.client_span(f"{endpoint.subject} request") as headers:
                msg = await self.nc.request(endpoint.subject, payload.to_bytes(), timeout=timeout_s,
                                            headers=headers)
        except nats.errors.NoRespondersError:
            raise NoResponders(endpoint.subject) from None
        except nats.errors.TimeoutError:
            raise BusTimeout(endpoint.subject, timeout_s) from None
        if (err := _error_from_msg(msg, endpoint.subject)) is not None:
            raise err
        return endpoint.reply_type.from_bytes(msg.data)

    async def publish(self, endpoint: Endpoint[Req, WireModel], payload: Req) -> None:
        await self.nc.publish(endpoint.subject, payload.to_bytes(), headers=tracing.current_headers())

    async def js_publish(self, endpoint: Endpoint[Req, WireModel], payload: Req, *,
                         timeout_s: float = 5.0) -> int:
        """Publish into a JetStream stream and wait for its ack; returns the stream sequence."""
        with tracing.client_span(f"{endpoint.subject} publish", tracing.SpanKind.PRODUCER) as headers:
            ack = await self.js.publish(endpoint.subject, payload.to_bytes(), timeout=timeout_s, headers=headers)
        return ack.seq

    async def stream(self, endpoint: Endpoint[Req, Rep], payload: Req, *, first_timeout_s: float,
                     idle_timeout_s: float) -> AsyncIterator[Rep]:
        """Send one request and yield its streamed replies until the server closes the stream.

        ``first_timeout_s`` bounds the wait for the first reply (queueing), ``idle_timeout_s`` each
        gap after it. A disconnect from NATS meanwhile raises ``Disconnected`` once the replies
        received before it are yielded: later ones may have been lost. Closing the iterator early
        unsubscribes; cancelling the work at the server is the caller's business (its cancel
        subject). A reply that does not parse as the endpoint's reply type raises ``MalformedReply``
        and ends the stream."""
        assert endpoint.reply_type is not None, f"{endpoint.subject} is publish-only"
        async with contextlib.aclosing(self.stream_bytes(endpoint.subject, payload.to_bytes(),
                                                         first_timeout_s=first_timeout_s,
                                                         idle_timeout_s=idle_timeout_s)) as replies:
            async for data in replies:
                try:
                    reply = endpoint.reply_type.from_bytes(data)
                except ValidationError as exc:
                    raise MalformedReply(endpoint.subject, validation_message(exc)[0]) from None
                yield reply

    async def stream_bytes(self, subject: str, data: bytes, *, first_timeout_s: float,
                           idle_timeout_s: float) -> AsyncIterator[bytes]:
        """``stream`` with the request and its replies as bytes, unparsed: for a tool that judges
        what a responder sends (``tandem worker-check``). Error replies, the end marker, timeouts
        and disconnects are handled as in ``stream``."""
        inbox = self.nc.new_inbox()
        received: asyncio.Queue[Msg | None] = asyncio.Queue()  # None: the connection was lost

        async def on_reply(msg: Msg) -> None:
            received.put_nowait(msg)

        sub = await self.nc.subscribe(inbox, cb=on_reply, pending_msgs_limit=1 << 20)
        stop_listening = self.link.on_loss(lambda: received.put_nowait(None))
        try:
            await self.nc.publish(subject, data, reply=inbox, headers=tracing.current_headers())
            timeout = first_timeout_s
            while True:
                try:
                    msg = await asyncio.wait_for(received.get(), timeout)
                except asyncio.TimeoutError:
                    raise BusTimeout(subject, timeout) from None
                if msg is None:
                    raise Disconnected(subject)
                if (err := _error_from_msg(msg, subject)) is not None:
                    raise err
                if (msg.headers or {}).get(STREAM_HEADER) == "end":
                    return
                yield msg.data
                timeout = idle_timeout_s
        finally:
            stop_listening()
            with contextlib.suppress(nats.errors.Error):  # already closed or unsubscribed
                await sub.unsubscribe()

    # --- server side ------------------------------------------------------------------------------
    async def serve(self, endpoint: Endpoint[Req, Rep], handler: Callable[[Req], Awaitable[Rep]],
                    *, queue: str = "") -> None:
        """Answer requests on ``endpoint`` with ``handler``; ``queue`` spreads them over replicas."""

        async def run(msg: Msg, request: Req) -> None:
            reply = await handler(request)
            if msg.reply:
                await self.nc.publish(msg.reply, reply.to_bytes())

        await self._serve(endpoint, run, queue)

    async def serve_stream(self, endpoint: Endpoint[Req, Rep],
                           handler: Callable[[Req], AsyncIterator[Rep]], *, queue: str = "") -> None:
        """Answer each request with the items ``handler`` yields, then an end-of-stream marker."""

        async def run(msg: Msg, request: Req) -> None:
            if not msg.reply:
                raise ServiceError("bad_request", f"{endpoint.subject} needs a reply subject")
            async for item in handler(request):
                await self.nc.publish(msg.reply, item.to_bytes())
            await self.nc.publish(msg.reply, b"", headers={STREAM_HEADER: "end"})

        await self._serve(endpoint, run, queue)

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Return once the server has processed everything sent so far (e.g. a new subscription:
        a request sent after this finds its responder)."""
        await self.nc.flush(timeout=timeout_s)

    @contextlib.asynccontextmanager
    async def listening(self, subject: str) -> AsyncIterator[asyncio.Queue[bytes]]:
        """The bytes of every message on ``subject`` while in the block, unparsed, in a queue (for a
        tool that judges what a producer sends, as ``tandem worker-check`` its load reports)."""
        received: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_msg(msg: Msg) -> None:
            received.put_nowait(msg.data)

        sub = await self.nc.subscribe(subject, cb=on_msg)
        try:
            yield received
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def subscribe(self, endpoint: Endpoint[Req, WireModel],
                        handler: Callable[[Req], Awaitable[None]]) -> None:
        """Consume publish-only messages (no reply): a bad message is logged and dropped."""
        await self._serve(endpoint, lambda msg, request: handler(request), "", track=False)

    async def _serve(self, endpoint: Endpoint, run: Callable[[Msg, WireModel], Awaitable[None]],
                     queue: str, *, track: bool = True) -> None:
        async def on_msg(msg: Msg) -> None:
            task = asyncio.create_task(self._handle(endpoint, msg, run), name=msg.subject)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        sub = await self.nc.subscribe(endpoint.subject, queue=queue, cb=on_msg)
        (self._served if track else self._subs).append(sub)

    async def _handle(self, endpoint: Endpoint, msg: Msg, run) -> None:
        try:
            request = endpoint.request_type.from_bytes(msg.data)
        except ValidationError as exc:
            message, field = validation_message(exc)
            log.warning("bad message on %s: %s", msg.subject, message)
            await self._reply_error(msg, ErrorReply(code="bad_request", message=message, field=field))
            return
        bind_request_id(getattr(request, "request_id", None))  # this task's log lines name it
        try:
            with tracing.server_span(f"{endpoint.subject} process", msg.headers):
                await run(msg, request)
        except asyncio.CancelledError:
            raise
        except ServiceError as exc:
            log.info("%s: %s: %s", msg.subject, exc.code, exc.message)
            await self._reply_error(msg, ErrorReply(code=exc.code, message=exc.message, field=exc.field))
        except Exception as exc:  # noqa: BLE001 — the wrapper's whole point: log, count, keep serving
            self.num_handler_errors += 1
            log.exception("handler for %s failed", msg.subject)
            await self._reply_error(msg, ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}"))

    async def _reply_error(self, msg: Msg, error: ErrorReply) -> None:
        if msg.reply and not self.nc.is_closed:
            await self.nc.publish(msg.reply, error.to_bytes(), headers={ERROR_HEADER: error.code})

    async def stop_serving(self, timeout_s: float) -> int:
        """Stop taking requests, wait up to ``timeout_s`` for the ones in flight; returns how many
        were still running (and got cancelled)."""
        for sub in self._served:
            await sub.unsubscribe()
        self._served.clear()
        pending = set(self._tasks)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=timeout_s)
            for task in pending:
                task.cancel()
        if pending:  # which subjects' handlers held the drain up
            log.warning("%d handlers still running after %gs, cancelled: %s", len(pending), timeout_s,
                        ", ".join(sorted(task.get_name() for task in pending)))
        return len(pending)

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    # --- JetStream ------------------------------------------------------------------------------
    async def ensure_stream(self, name: str, subjects: list[str], *, max_age_s: float,
                            max_msgs: int, work_queue: bool = False) -> None:
        """Create the stream, or bring an existing one's subjects and bounds up to date.

        ``work_queue``: a message is removed once acknowledged, and a full stream refuses new
        messages (the publisher gets an error) instead of silently dropping the oldest. After a
        reconnect it is ensured again: a server that lost its store lost the stream too."""
        config = StreamConfig(name=name, subjects=subjects, max_age=max_age_s, max_msgs=max_msgs,
                              num_replicas=self.replicas)
        if work_queue:
            config = StreamConfig(name=name, subjects=subjects, max_age=max_age_s, max_msgs=max_msgs,
                                  retention=RetentionPolicy.WORK_QUEUE, discard=DiscardPolicy.NEW,
                                  num_replicas=self.replicas)
        await self._add_or_update_stream(config)
        self.link.on_resume(f"stream {name}", lambda: self._add_or_update_stream(config))

    async def _add_or_update_stream(self, config: StreamConfig) -> None:
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await self.js.update_stream(config)
        await self._wait_for_leader(config.name)

    async def _wait_for_leader(self, stream: str, timeout_s: float = 15.0) -> None:
        """A replicated stream (a bucket is one too) elects its leader a moment after it is created;
        until then a write gets no response from the stream, and a worker's first write failed so
        at start-up on a 3-member cluster. Wait until it has one (at most ``timeout_s``, then go on:
        the write will say what is wrong)."""
        if self.replicas <= 1:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                info = await self.js.stream_info(stream)
                if info.cluster is None or info.cluster.leader:
                    return
            if time.monotonic() >= deadline:
                log.warning("stream %s has no leader after %.0f s", stream, timeout_s)
                return
            await asyncio.sleep(0.1)

    async def pull_consumer(self, endpoint: Endpoint[Req, WireModel], stream: str, durable: str, *,
                            ack_wait_s: float, max_deliver: int, max_ack_pending: int = 1000) -> WorkQueue[Req]:
        """Bind to (creating if needed) the durable pull consumer ``durable`` on ``stream``:
        explicit acks, redelivery ``ack_wait_s`` after the last ack or ``in_progress``, at most
        ``max_deliver`` deliveries. After a reconnect the consumer is created again if the server
        lost it (its store gone); one that survived is left as it is."""
        config = ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait_s,
                                max_deliver=max_deliver, max_ack_pending=max_ack_pending,
                                filter_subject=endpoint.subject)
        sub = await self.js.pull_subscribe(endpoint.subject, durable=durable, stream=stream, config=config)

        async def recreate_if_lost() -> None:
            if await self.consumer_info(stream, durable) is None:
                await self.js.add_consumer(stream, config)

        self.link.on_resume(f"consumer {stream}/{durable}", recreate_if_lost)
        return WorkQueue(endpoint, sub)

    async def consumer_info(self, stream: str, durable: str) -> ConsumerState | None:
        """The consumer's counts, or None if it or its stream does not exist."""
        try:
            return ConsumerState.of(await self.js.consumer_info(stream, durable))
        except nats.js.errors.NotFoundError:
            return None

    async def stream_state(self, stream: str) -> StreamState | None:
        """The stream's message count and sequence range, or None if it does not exist."""
        try:
            return StreamState.of(await self.js.stream_info(stream))
        except nats.js.errors.NotFoundError:
            return None

    async def key_value(self, bucket: str, *, ttl_s: float | None = None) -> KvBucket:
        """Bind to a KV bucket, creating it (history 1, entries expiring after ``ttl_s`` if given)
        when it does not exist; an existing bucket keeps the settings it was created with. After a
        reconnect it is created again if the server lost it."""
        kv = KvBucket(await self._bind_key_value(bucket, ttl_s), self.js, bucket)
        self.link.on_resume(f"bucket {bucket}", lambda: self._bind_key_value(bucket, ttl_s))
        return kv

    async def find_key_value(self, bucket: str) -> KvBucket | None:
        """Bind to the bucket if it exists (None if not); unlike ``key_value``, create nothing."""
        try:
            return KvBucket(await self.js.key_value(bucket), self.js, bucket)
        except nats.js.errors.BucketNotFoundError:
            return None

    async def _bind_key_value(self, bucket: str, ttl_s: float | None):
        async def bind():
            try:
                return await self.js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                config = KeyValueConfig(bucket=bucket, history=1, ttl=ttl_s, replicas=self.replicas)
                try:
                    return await self.js.create_key_value(config)
                except nats.js.errors.BadRequestError:  # created concurrently by another process
                    return await self.js.key_value(bucket)

        kv = await self._while_electing(bind, f"KV_{bucket}")
        await self._wait_for_leader(f"KV_{bucket}")
        return kv

    async def _while_electing(self, bind: Callable[[], Awaitable[T]], stream: str, timeout_s: float = 30.0) -> T:
        """``bind()``, asked again while JetStream does not answer in time: a replicated bucket that
        another process is creating at the same moment (every worker of a stack starting on a fresh
        3-member cluster) answers nothing until its raft group has elected a leader, and a worker's
        start-up failed so (``nats: timeout``) on a loaded host. After ``timeout_s`` the timeout is
        raised."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await bind()
            except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.js.errors.ServiceUnavailableError) as exc:
                if time.monotonic() >= deadline:
                    raise
                log.info("binding %s: %r; asking again (a leader may be being elected)", stream, exc)
                await asyncio.sleep(0.5)

    async def object_store(self, bucket: str) -> ObjectBucket:
        """Bind to an Object Store bucket, creating it (file storage, no expiry) when it does not
        exist. After a reconnect it is created again if the server lost it."""
        store = ObjectBucket(await self._bind_object_store(bucket), self.js, bucket)
        self.link.on_resume(f"object store {bucket}", lambda: self._bind_object_store(bucket))
        return store

    async def _bind_object_store(self, bucket: str):
        async def bind():
            try:
                return await self.js.object_store(bucket)
            except nats.js.errors.BucketNotFoundError:
                try:
                    return await self.js.create_object_store(bucket, ObjectStoreConfig(replicas=self.replicas))
                except nats.js.errors.BadRequestError:  # created concurrently by another process
                    return await self.js.object_store(bucket)

        store = await self._while_electing(bind, f"OBJ_{bucket}")
        await self._wait_for_leader(f"OBJ_{bucket}")
        return store

    async def purge_subject(self, stream: str, subject: str) -> None:
        """Remove every message of ``stream`` on ``subject`` (e.g. one batch's queued work items);
        a message being worked on is gone too: its later ack is a no-op."""
        await self.js.purge_stream(stream, subject=subject)

    async def replay(self, endpoint: Endpoint[Req, WireModel], stream: str,
                     handler: Callable[[Req, int], Awaitable[None]], *, start_seq: int = 0) -> Replay[Req]:
        """Deliver every message of ``stream`` on ``endpoint`` from ``start_seq`` (0: the first
        still stored) on, then new ones as they come, in order, one at a time, to
        ``handler(message, stream_seq)``, across NATS restarts (``shared.bus.replay``). A malformed
        message is logged and skipped. The returned replay can be started over or stopped."""

        def count_error() -> None:
            self.num_handler_errors += 1

        replay = Replay(self.js, endpoint, stream, handler, count_error)
        await replay.start(start_seq)
        self.link.on_resume(f"replay of {stream} #{id(replay)}", replay.resume)
        return replay

    async def close(self) -> None:
        self.link.close()
        for task in list(self._tasks):
            task.cancel()
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except (nats.errors.Error, asyncio.TimeoutError) as exc:  # server gone: just close
                log.warning("nats %s: drain failed (%s); closing", self.name, exc)
                await self.nc.close()
