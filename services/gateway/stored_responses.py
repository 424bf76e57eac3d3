"""``/v1/responses`` with OpenAI's stored responses: ``store`` (the default), ``previous_response_id``,
``conversation`` (``services.gateway.conversations``) and ``background`` on create; ``GET`` and
``DELETE /v1/responses/{id}``, ``/input_items`` and ``/cancel``, answered by any gateway from the
store in NATS (``shared.openai_api.stored``).

A background response runs in the gateway that took it, as a task beside its HTTP site, and its
record names that gateway (``origin``) until it ends. A gateway that reads a record still queued or
in progress from another origin asks that origin whether it is there (``origin_alive``, as the
workers ask): nobody answering means its gateway died with it, and the record becomes ``failed``;
nothing runs it again. A cancel, from any gateway, makes the record ``cancelled`` by
compare-and-set; the running gateway looks at its record every ``_WATCH_INTERVAL_S`` and stops
the generation (at once when the cancel came to it). Admission's 429 does not fail a background
response (its caller is not there to retry): it waits for the rejection's Retry-After and asks
again (``shared.openai_api.retry``), for up to ``background_retry_max_wait_s`` in all.

Each record names its owner, the API key's owner id (``ApiKeys.owner``): with keys configured, a
response of another key is a 404 to every endpoint here and to ``previous_response_id``, as if
it did not exist. Without keys every response is every caller's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from services.gateway.batch_api import list_limit
from services.gateway.conversations import Conversations
from services.gateway.core import GatewayCore
from shared.bus.errors import NoResponders
from shared.bus.kv import Versioned
from shared.openai_api.adapters import ResponseHead
from shared.openai_api.auth import owns
from shared.openai_api.errors import ApiError
from shared.openai_api.responses_api import ResponsesAdapter
from shared.openai_api.retry import retry_wait_s, waiting_out_429s  # noqa: F401 — retry_wait_s: tests import it here
from shared.openai_api.stored.items import input_items, items_page, stored, with_status
from shared.openai_api.stored.store import ResponseNotFound, ResponseStore
from shared.policy.qos import ServedTier
from shared.protocol import GenerateRequest, OriginPing
from shared.protocol.responses import StoredResponse

log = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.5
_ORIGIN_TIMEOUT_S = 1.0
# a record is one NATS message (1 MiB by default): the input must leave room for the response
_MAX_STORED_INPUT_BYTES = 768 << 10
_CANCEL_TRIES = 5


class StoredResponses:
    def __init__(self, gateway: GatewayCore, store: ResponseStore, conversations: Conversations | None = None) -> None:
        self._gateway, self._store, self._conversations = gateway, store, conversations
        self._tasks: dict[str, asyncio.Task] = {}  # background responses running here, by id

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/responses/{response_id}", self.get)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)
        app.router.add_get("/v1/responses/{response_id}/input_items", self.input_items)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Background responses run for the block; those still running at its end are stopped
        (their records stay in progress until another gateway finds their origin gone)."""
        try:
            yield
        finally:
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- create ----------------------------------------------------------------------------------
    async def create(self, request: web.Request, api: ResponsesAdapter, served: ServedTier,
                     arrived_at: float) -> web.StreamResponse:
        """``POST /v1/responses`` once parsed (``Gateway.answer`` does the generation)."""
        body = api.body
        own = input_items(body)
        owner = self._gateway.api_keys.owner(request.headers.get("Authorization"))
        if body.previous_response_id is not None:
            api = ResponsesAdapter(body.continued(await self.history(body.previous_response_id, owner)),
                                   api.tokenizer)
        if body.conversation_id is not None:
            if self._conversations is None:
                raise ApiError(400, "conversations are not stored by this gateway", param="conversation",
                               code="unsupported_parameter")
            api = ResponsesAdapter(body.continued(await self._conversations.history(body.conversation_id, owner, own)),
                                   api.tokenizer)
        if body.store and (size := len(json.dumps(own))) > _MAX_STORED_INPUT_BYTES:
            raise ApiError(400, f"input is too large to store ({size} bytes of items, at most "
                           f"{_MAX_STORED_INPUT_BYTES}); send store: false", param="input", code="input_too_large")
        if body.background:
            return await self._start_background(api, own, served, owner)
        if not body.store and body.conversation_id is None:
            return await self._gateway.answer(request, api, served, arrived_at)

        async def keep() -> None:
            if api.completed is None:
                return
            if body.store:
                await self._keep(stored(api.completed, own, body, owner=owner))
            await self._add_turn(body.conversation_id, own, api.completed)

        return await self._gateway.answer(request, api, served, arrived_at, keep)

    async def _add_turn(self, conversation_id: str | None, own: list[dict], response: dict) -> None:
        """A made response's input and output items, added to its conversation (if it has one)."""
        if conversation_id is not None and self._conversations is not None \
                and response["status"] in ("completed", "incomplete"):
            await self._conversations.add_turn(conversation_id, own + response["output"])

    async def history(self, previous_id: str, owner: str | None) -> list[dict]:
        """The items of the stored conversation ending in ``previous_id``, oldest first (online and
        batch lines: ``batch_runner.History``): a 404 for one ``owner`` may not see, a 400 for one
        still running."""
        try:
            last, items = await self._store.conversation(previous_id, owner)
        except ResponseNotFound as exc:
            what = "Previous response" if exc.response_id == previous_id else \
                f"Response {exc.response_id!r}, earlier in the conversation of previous response"
            raise _not_found(f"{what} with id {previous_id!r} not found.", "previous_response_id",
                             "previous_response_not_found") from None
        if not last.is_final:
            raise ApiError(400, f"Previous response {previous_id!r} is still {last.status}; wait for it to end",
                           param="previous_response_id", code="previous_response_not_completed")
        return items

    async def _keep(self, record: StoredResponse) -> None:
        """Store a finished response; a failure costs the client nothing but the stored copy."""
        try:
            await self._store.create(record)
        except Exception:  # noqa: BLE001 — the answer is made: log, and answer it all the same
            log.exception("%s: could not store the response", record.id)

    # --- background ------------------------------------------------------------------------------
    async def _start_background(self, api: ResponsesAdapter, own: list[dict], served: ServedTier,
                                owner: str | None) -> web.Response:
        # the request is built first: a prompt too long for the model is a 400 now, not a failed record
        gen_request = await self._gateway.prepared_request(api, served.tier)
        head = ResponseHead(gen_request.request_id, int(gen_request.created_at), gen_request.model,
                            served.service_tier)
        queued = api.shell(head, "queued")
        record = stored(queued, own, api.body, origin=self._gateway.origin, owner=owner)
        await self._store.create(record)
        task = asyncio.create_task(self._run(api, gen_request, head, record, own))
        self._tasks[record.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(record.id, None))
        return web.json_response(queued)

    async def _run(self, api: ResponsesAdapter, gen_request: GenerateRequest, head: ResponseHead,
                   record: StoredResponse, own: list[dict]) -> None:
        origin = self._gateway.origin
        current = await self._store.get(record.id)
        if current is not None:
            current = await self._store.replace(current, with_status(record, api.shell(head, "in_progress"),
                                                                     origin=origin))
        if current is None:
            return  # cancelled or deleted before it started
        try:
            response = await self._watched(asyncio.create_task(self._collect(api, gen_request, head, record.id)),
                                           record.id)
        except ApiError as exc:
            response = _failed(api.shell(head, "failed"), exc.message,
                               "rate_limit_exceeded" if exc.status == 429 else "server_error")
        except Exception as exc:  # noqa: BLE001 — a bug or NATS trouble: the record must still end
            log.exception("%s: background response failed", record.id)
            response = _failed(api.shell(head, "failed"), f"internal error: {type(exc).__name__}", "server_error")
        if response is None:
            return
        # the turn lands in its conversation before the record says completed: a client that sees
        # the status and lists the conversation's items finds the turn there
        if not await self._is_wanted(record.id):
            log.info("%s: cancelled or deleted while it ran; its result is dropped", record.id)
            return
        await self._add_turn(api.body.conversation_id, own, response)
        if await self._store.replace(current, with_status(record, response)) is None:
            log.info("%s: cancelled or deleted as it ended; its result is dropped (its turn stays in "
                     "the conversation)", record.id)

    async def _collect(self, api: ResponsesAdapter, gen_request: GenerateRequest, head: ResponseHead,
                       response_id: str) -> dict:
        """The response body, after waiting out admission's 429s (``waiting_out_429s``); the last
        rejection once the wait is over. Run under ``_watched``: a cancel stops a wait too."""
        return await waiting_out_429s(lambda: self._gateway.collect(api, gen_request, head.service_tier),
                                      self._gateway.settings.background_retry_max_wait_s, response_id)

    async def _watched(self, work: asyncio.Task, response_id: str) -> dict | None:
        """``work``'s result; None (and ``work`` stopped) once the response is cancelled or deleted."""
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=_WATCH_INTERVAL_S)
                if not work.done() and not await self._is_wanted(response_id):
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
                    return None
            return work.result()
        finally:
            if not work.done():  # this task was cancelled (a local cancel, shutdown)
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)

    async def _is_wanted(self, response_id: str) -> bool:
        try:
            current = await self._store.get(response_id)
        except Exception:  # noqa: BLE001 — NATS reconnecting: keep going, look again next round
            return True
        return current is not None and current.record.status != "cancelled"

    # --- read, delete, cancel --------------------------------------------------------------------
    async def get(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        current = await self._current(request.match_info["response_id"], owner)
        return web.json_response(json.loads(current.record.response))

    async def input_items(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        current = await self._current(request.match_info["response_id"], owner)
        return web.json_response(items_page(json.loads(current.record.input_items), limit=list_limit(request, 100),
                                            order=request.query.get("order", "desc"),
                                            after=request.query.get("after")))

    async def delete(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        response_id = request.match_info["response_id"]
        await self._visible(response_id, owner)
        if not await self._store.delete(response_id):
            raise _no_response(response_id)
        if (task := self._tasks.get(response_id)) is not None:
            task.cancel()  # elsewhere, the running gateway sees the record gone within a round
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        response_id = request.match_info["response_id"]
        for _ in range(_CANCEL_TRIES):  # a record changes a few times at most: queued, in progress, its end
            current = await self._current(response_id, owner)
            record = current.record
            if not record.background:
                raise ApiError(400, "Only responses created with background: true can be cancelled.",
                               param="response_id", code="invalid_value")
            response = json.loads(record.response)
            if record.status == "cancelled":
                return web.json_response(response)
            if record.is_final:
                raise ApiError(400, f"Cannot cancel a response that is already {record.status}.",
                               param="response_id", code="invalid_value")
            response["status"] = "cancelled"
            if await self._store.replace(current, with_status(record, response)) is not None:
                if (task := self._tasks.get(response_id)) is not None:
                    task.cancel()
                return web.json_response(response)
        raise ApiError(503, f"response {response_id} kept changing while it was cancelled; try again",
                       retry_after_s=1.0)

    async def _visible(self, response_id: str, owner: str | None) -> Versioned[StoredResponse]:
        """The stored response; a 404 if there is none or it is another owner's."""
        if (current := await self._store.get(response_id)) is None or not owns(owner, current.record.owner):
            raise _no_response(response_id)
        return current

    async def _current(self, response_id: str, owner: str | None) -> Versioned[StoredResponse]:
        """The stored response (404 if none, or another owner's); one still running on a gateway
        that is gone is marked failed first."""
        current = await self._visible(response_id, owner)
        origin = current.record.origin
        if current.record.is_final or origin is None or origin == self._gateway.origin \
                or not await self._origin_gone(origin):
            return current
        failed = _failed(json.loads(current.record.response), "the gateway running this response stopped",
                         "server_error")
        return await self._store.replace(current, with_status(current.record, failed)) or \
            await self._current(response_id, owner)  # it changed meanwhile: read it again

    async def _origin_gone(self, origin: str) -> bool:
        """True only when nobody answers for ``origin`` (a timeout says nothing either way)."""
        gateway = self._gateway
        try:
            await gateway.bus.request(gateway.subjects.origin_alive(origin), OriginPing(worker_id=gateway.origin),
                                      timeout_s=_ORIGIN_TIMEOUT_S)
        except NoResponders:
            return True
        except Exception as exc:  # noqa: BLE001 — NATS reconnecting: cannot say
            log.debug("origin %s: no answer (%s)", origin, exc)
        return False

    def _authorize(self, request: web.Request) -> str | None:
        """The caller's owner id; a 401 for a bad key."""
        return self._gateway.api_keys.owner(request.headers.get("Authorization"))


def _failed(response: dict, message: str, code: str) -> dict:
    return {**response, "status": "failed", "output": [], "error": {"code": code, "message": message}}


def _not_found(message: str, param: str, code: str) -> ApiError:
    # OpenAI reports a missing response as an invalid request, not as a missing route
    return ApiError(404, message, param=param, code=code, error_type="invalid_request_error")


def _no_response(response_id: str) -> ApiError:
    return _not_found(f"Response with id {response_id!r} not found.", "response_id", "response_not_found")
