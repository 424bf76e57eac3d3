"""The batch runner: every gateway pulls batch lines from the shared work queue and runs each as
the same request sent online, at a priority below every tier.

Why in the gateway and not a service of its own: a line is an OpenAI request, and the gateway is
what turns one into tokens and back (chat template, tokenization, admission, the worker's stream,
migration when a worker dies, detokenization, stop strings, the response body). Running lines here
reuses that path whole (``Gateway.generate_request``, ``Gateway.collect``), so a
greedy line's body is the online one by construction, with no HTTP hop and no API key to hold.
Lines go through admission like any request, with the lowest tier's SLO and a priority below every
tier's (``batch_priority``): admission sheds them first and the engine and the prefill queue serve
and preempt them last, so they fill idle capacity and yield to online traffic; an admission
rejection (429/503) is waited out and retried, never written as the line's result. Every gateway
pulls from one durable consumer, so batch capacity grows with the gateways, and a dead gateway's
lines come back to the others after the ack wait. While a gateway serves online requests its runner
starts lines only up to ``batch_in_flight_beside_online`` (``line_limit``): priority decides who goes
first, but not how long each engine step takes, and batch rows lengthen every step online rows share.
A gateway judges online traffic by its own requests; behind a load balancer that spreads them, each
gateway sees its share.

Exactly once: a line is acknowledged only after its result is stored, and the store keeps the
first result per (batch, custom_id) (``BatchStore.store_result``): a redelivered line that already
has one is acknowledged without running. A line of a batch that is no longer running (cancelled,
expired) is dropped, and lines running when their batch is cancelled are stopped (the worker is
told to cancel) within ``_WATCH_INTERVAL_S``.

A ``/v1/responses`` line with ``previous_response_id`` continues that stored response as online
(``History``), as its batch's owner: another key's response fails the line with online's 404. A
line's own response is not stored (no later line or request can continue it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from services.gateway.core import GatewayCore
from shared.bus import QueueMessage
from shared.openai_api.adapters import ApiAdapter, ChatAdapter, CompletionAdapter
from shared.openai_api.batch.store import BatchStore
from shared.openai_api.errors import ApiError
from shared.openai_api.responses_api import ResponsesAdapter
from shared.policy.qos import QosConfig
from shared.protocol import GenerateRequest
from shared.protocol.batch import BatchLineRequest, BatchLineResult

log = logging.getLogger(__name__)

ADAPTERS: dict[str, type[ApiAdapter]] = {"/v1/chat/completions": ChatAdapter, "/v1/completions": CompletionAdapter,
                                         "/v1/responses": ResponsesAdapter}
_RUNNING = ("validating", "in_progress")   # a line of a batch in any other status is not run
_RETRY_STATUSES = (429, 503)               # admission's "not now": wait and ask again
_MAX_RETRY_WAIT_S = 5.0
_WATCH_INTERVAL_S = 0.5
_LIMIT_RECHECK_S = 0.25  # how often a runner at its limit looks whether online traffic went quiet

# (previous_response_id, owner) → the items of that stored conversation, oldest first, as ``owner``
# may see them (``StoredResponses.history``); raises online's ApiError (404 for another owner's)
History = Callable[[str, str | None], Awaitable[list[dict]]]


@dataclass(frozen=True)
class RunnerConfig:
    max_in_flight: int        # lines this gateway runs at once
    ack_wait_s: float         # a line not acknowledged or touched for this long goes to another runner
    max_deliver: int
    in_flight_beside_online: int  # the limit while online traffic runs (max_in_flight at most)
    online_quiet_s: float         # online traffic "runs" until this long after its last request


def line_limit(config: RunnerConfig, *, online_in_flight: int, since_online_s: float) -> int:
    """How many lines may run now. Every batch row lengthens each engine step that online rows share
    (on a CPU nearly in proportion), and the step in progress is what an online prefill waits for, so
    while online requests run (or ran within ``online_quiet_s``: Poisson arrivals leave short gaps)
    the batch keeps to ``in_flight_beside_online`` and takes the whole ``max_in_flight`` only when the
    gateway is quiet. Lines already running are not stopped: the limit holds back new ones."""
    if online_in_flight > 0 or since_online_s < config.online_quiet_s:
        return min(config.in_flight_beside_online, config.max_in_flight)
    return config.max_in_flight


def batch_tier(qos: QosConfig) -> tuple[str, int]:
    """The tier batch lines run in (the lowest: admission holds them to its SLO) and their priority,
    one below that tier's, so that they also yield to that tier's online requests."""
    name, tier = max(qos.tiers.items(), key=lambda item: item[1].priority)
    return name, tier.priority + 1


class BatchRunner:
    def __init__(self, gateway: GatewayCore, store: BatchStore, config: RunnerConfig,
                 history: History | None = None) -> None:
        """``history``: stored responses for ``previous_response_id`` (None: a line with one fails)."""
        self._gateway, self._store, self._config, self._history = gateway, store, config, history
        self._tier, self._priority = batch_tier(gateway.qos)
        self._tasks: dict[asyncio.Task, str] = {}  # running line → its batch id
        self._held: collections.deque[QueueMessage[BatchLineRequest]] = collections.deque()  # fetched, not started

    async def run_forever(self) -> None:
        queue = await self._store.line_consumer(ack_wait_s=self._config.ack_wait_s,
                                                max_deliver=self._config.max_deliver,
                                                max_ack_pending=max(1000, self._config.max_in_flight * 4))
        watcher = asyncio.create_task(self._watch_batches())
        keeper = asyncio.create_task(self._keep_held_alive())
        try:
            while True:
                limit = self._limit()
                while self._held and len(self._tasks) < limit:
                    self._start(self._held.popleft())
                if len(self._tasks) >= limit:
                    # a line ending, or online traffic going quiet, makes room
                    if self._tasks:
                        await asyncio.wait(set(self._tasks), timeout=_LIMIT_RECHECK_S,
                                           return_when=asyncio.FIRST_COMPLETED)
                    else:
                        await asyncio.sleep(_LIMIT_RECHECK_S)
                    continue
                try:
                    # online traffic may start while the fetch waits: the lines it brings are
                    # started (above) against the limit of the moment they arrive, not of now
                    self._held.extend(await queue.fetch(limit - len(self._tasks), timeout_s=1.0))
                except Exception as exc:  # noqa: BLE001 — NATS reconnecting: pull again shortly
                    log.warning("batch lines: fetch failed: %r", exc)
                    await asyncio.sleep(1.0)
        finally:
            watcher.cancel()
            keeper.cancel()
            for task in list(self._tasks):
                task.cancel()  # unacknowledged: redelivered to another gateway after the ack wait
            await asyncio.gather(watcher, keeper, *self._tasks, return_exceptions=True)
            self._held.clear()  # likewise
            await queue.close()

    def _start(self, message: QueueMessage[BatchLineRequest]) -> None:
        task = asyncio.create_task(self._settle(message))
        self._tasks[task] = message.payload.batch_id
        task.add_done_callback(self._done)
        self._gateway.metrics.observe_batch_lines(len(self._tasks))

    async def _keep_held_alive(self) -> None:
        """Lines fetched but not started (online traffic began while they were fetched) stay this
        runner's: their ack wait is renewed until they start."""
        while True:
            await asyncio.sleep(self._config.ack_wait_s / 3)
            for message in list(self._held):
                with contextlib.suppress(Exception):
                    await message.in_progress()

    def _limit(self) -> int:
        metrics = self._gateway.metrics
        return line_limit(self._config, online_in_flight=metrics.num_in_flight,
                          since_online_s=time.monotonic() - metrics.online_ended_at)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.pop(task, None)
        self._gateway.metrics.observe_batch_lines(len(self._tasks))
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("batch line failed unexpectedly (it is delivered again): %r", exc)

    async def _watch_batches(self) -> None:
        """Stop the lines of batches that stopped running (cancelled, expired)."""
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            for batch_id in set(self._tasks.values()):
                with contextlib.suppress(Exception):  # NATS reconnecting: look again next round
                    if not await self._is_running(batch_id):
                        for task, owner in list(self._tasks.items()):
                            if owner == batch_id:
                                task.cancel()

    async def _is_running(self, batch_id: str) -> bool:
        current = await self._store.get(batch_id)
        return current is not None and current.record.status in _RUNNING

    async def _settle(self, message: QueueMessage[BatchLineRequest]) -> None:
        line = message.payload
        batch = await self._store.get(line.batch_id)
        if batch is None or batch.record.status not in _RUNNING \
                or await self._store.has_result(line.batch_id, line.custom_id):
            await message.ack()
            return
        keepalive = asyncio.create_task(self._keep_alive(message))
        try:
            result = await self._run(line, batch.record.owner,
                                     is_last_try=message.num_delivered >= self._config.max_deliver)
        finally:
            keepalive.cancel()
        if await self._store.store_result(result):
            log.info("batch %s line %d (%s, request %s): %s", line.batch_id, line.line, line.custom_id,
                     result.request_id, result.status_code or result.error_code)
        await message.ack()

    async def _keep_alive(self, message: QueueMessage) -> None:
        while True:
            await asyncio.sleep(self._config.ack_wait_s / 3)
            with contextlib.suppress(Exception):
                await message.in_progress()

    async def _run(self, line: BatchLineRequest, owner: str | None, *, is_last_try: bool) -> BatchLineResult:
        """The line's result: the online answer to ``owner`` (the batch's), after waiting out
        admission's rejections. An unexpected failure leaves the line to its next delivery, or on
        the last one is its result (a 500), so that the batch still completes."""
        while True:
            try:
                outcome = await execute(self._gateway, line, tier=self._tier, priority=self._priority,
                                        owner=owner, history=self._history)
            except Exception as exc:  # noqa: BLE001 — a bug or NATS trouble: the line must end somewhere
                if not is_last_try:
                    raise
                log.exception("batch %s line %d failed on its last delivery", line.batch_id, line.line)
                outcome = Outcome("", 500, ApiError(500, f"internal error: {type(exc).__name__}").body())
            if outcome.status not in _RETRY_STATUSES:
                break
            wait_s = min(outcome.retry_after_s or 1.0, _MAX_RETRY_WAIT_S)
            log.info("batch %s line %d: %d, again in %.1fs", line.batch_id, line.line, outcome.status, wait_s)
            await asyncio.sleep(wait_s)
        return BatchLineResult(batch_id=line.batch_id, line=line.line, custom_id=line.custom_id,
                               request_id=outcome.request_id, status_code=outcome.status,
                               body=json.dumps(outcome.body))


@dataclass(frozen=True)
class Outcome:
    request_id: str
    status: int                         # the HTTP status the request got (200, or the error's)
    body: dict                          # the JSON body it got
    retry_after_s: float | None = None  # a rejection's Retry-After


async def execute(gateway: GatewayCore, line: BatchLineRequest, *, tier: str, priority: int,
                  owner: str | None = None, history: History | None = None) -> Outcome:
    """Run one line as the gateway runs the same request online (``Gateway._generate_traced``)
    for ``owner``, without the HTTP around it. Unexpected failures once the request has left (NATS
    trouble, reading ``history`` included) are raised, for the line's next delivery."""
    request_id = ""
    try:
        api, gen_request = await line_request(gateway, line, tier=tier, priority=priority, owner=owner,
                                              history=history)
        request_id = gen_request.request_id
        return Outcome(request_id, 200, await gateway.collect(api, gen_request))
    except ApiError as exc:
        return Outcome(request_id, exc.status, exc.body(), exc.retry_after_s)


async def line_request(gateway: GatewayCore, line: BatchLineRequest, *, tier: str, priority: int,
                       owner: str | None = None, history: History | None = None) -> tuple[ApiAdapter, GenerateRequest]:
    """The line as a request, parsed and tokenized off the event loop as online requests are
    (``prepared_request``), after the earlier turns of its ``previous_response_id`` that ``owner``
    may see (``continued``); an ``ApiError`` when it cannot be one."""
    with _line_input_errors(line):
        api = await asyncio.to_thread(ADAPTERS[line.url].from_json, line.body.encode(), gateway.tokenizer)
        if api.body.stream:
            raise ApiError(400, "stream is not supported in a batch", param="stream", code="invalid_value")
    api = await continued(api, owner, history)  # NATS: its trouble is raised, for the next delivery
    with _line_input_errors(line):
        return api, (await gateway.prepared_request(api, tier)).model_copy(update={"priority": priority})


async def continued(api: ApiAdapter, owner: str | None, history: History | None) -> ApiAdapter:
    """A ``/v1/responses`` body with ``previous_response_id`` after that conversation's items, as
    ``StoredResponses.create`` does online, and refused as online for a response ``owner`` may not
    see; any other body as it is."""
    if not isinstance(api, ResponsesAdapter) or api.body.previous_response_id is None:
        return api
    if history is None:
        raise ApiError(400, "previous_response_id needs stored responses, which this gateway does not keep",
                       param="previous_response_id", code="unsupported_parameter")
    return ResponsesAdapter(api.body.continued(await history(api.body.previous_response_id, owner)), api.tokenizer)


@contextlib.contextmanager
def _line_input_errors(line: BatchLineRequest) -> Iterator[None]:
    """Local work on a line's input fails every delivery alike, so any failure in it but an
    ``ApiError`` is a 500 ``ApiError`` too, the line's result at once: raised, it would hold the
    batch in progress for ``max_deliver`` ack waits."""
    try:
        yield
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 — a bug met on this line's input
        log.exception("batch %s line %d could not be made a request", line.batch_id, line.line)
        raise ApiError(500, f"internal error: {type(exc).__name__}") from None
