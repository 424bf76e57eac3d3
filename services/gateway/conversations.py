"""``/v1/conversations`` (OpenAI's Conversations API), answered by any gateway from the store in
NATS (``shared.openai_api.stored.conversation_store``), and what ``/v1/responses`` does with a
``conversation``: its items go before the request's input, and the request's input items and the
response's output items are added to it once the response is made.

Each conversation names its owner, the API key's owner id (``ApiKeys.owner``): with keys
configured, another key's conversation is a 404 to every endpoint here and to ``conversation``
on ``/v1/responses``, as if it did not exist. Without keys every conversation is every caller's."""

from __future__ import annotations

import logging

from aiohttp import web

from shared.openai_api.adapters import parse_body
from shared.openai_api.auth import owns
from shared.openai_api.conversations import AddItemsBody, CreateConversationBody, UpdateConversationBody
from shared.openai_api.errors import ApiError
from shared.protocol.conversations import StoredConversation
from shared.openai_api.stored.conversation_store import ConversationStore
from shared.openai_api.stored.conversations import (check_new_items, conversation_object, deleted_object,
                                            new_conversation)
from shared.openai_api.stored.items import as_item, items_page
from services.gateway.batch_api import list_limit
from services.gateway.core import GatewayCore

log = logging.getLogger(__name__)


class Conversations:
    def __init__(self, gateway: GatewayCore, store: ConversationStore) -> None:
        self._gateway, self._store = gateway, store

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/conversations", self.create)
        app.router.add_get("/v1/conversations/{conversation_id}", self.get)
        app.router.add_post("/v1/conversations/{conversation_id}", self.update)
        app.router.add_delete("/v1/conversations/{conversation_id}", self.delete)
        app.router.add_get("/v1/conversations/{conversation_id}/items", self.list_items)
        app.router.add_post("/v1/conversations/{conversation_id}/items", self.add_items)
        app.router.add_get("/v1/conversations/{conversation_id}/items/{item_id}", self.get_item)
        app.router.add_delete("/v1/conversations/{conversation_id}/items/{item_id}", self.delete_item)

    # --- the API ---------------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        body = parse_body(await request.read() or b"{}", CreateConversationBody)
        record = new_conversation(body.metadata, owner)
        items = [as_item(item) for item in body.items or []]
        check_new_items(record, items, "items")
        return web.json_response(conversation_object(await self._store.create(record, items)))

    async def get(self, request: web.Request) -> web.Response:
        record = await self._visible(request.match_info["conversation_id"], self._authorize(request))
        return web.json_response(conversation_object(record))

    async def update(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        conversation_id = request.match_info["conversation_id"]
        body = parse_body(await request.read(), UpdateConversationBody)
        await self._visible(conversation_id, owner)
        if (record := await self._store.set_metadata(conversation_id, body.metadata or {})) is None:
            raise _no_conversation(conversation_id)
        return web.json_response(conversation_object(record))

    async def delete(self, request: web.Request) -> web.Response:
        conversation_id = request.match_info["conversation_id"]
        await self._visible(conversation_id, self._authorize(request))
        if not await self._store.delete(conversation_id):
            raise _no_conversation(conversation_id)
        return web.json_response(deleted_object(conversation_id))

    async def list_items(self, request: web.Request) -> web.Response:
        """A page of ids first, then only that page's items are read. ``include`` is accepted:
        nothing it names (logprobs, image URLs, tool results) is kept here."""
        record = await self._visible(request.match_info["conversation_id"], self._authorize(request))
        ids = [{"id": item_id} for item_id in record.item_ids]
        shown = items_page(ids, limit=list_limit(request, 100), order=request.query.get("order", "desc"),
                           after=request.query.get("after"))
        data = await self._store.items(record.id, [i["id"] for i in shown["data"]])
        return web.json_response({**shown, "data": data, "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None})

    async def add_items(self, request: web.Request) -> web.Response:
        owner = self._authorize(request)
        conversation_id = request.match_info["conversation_id"]
        body = parse_body(await request.read(), AddItemsBody)
        await self._visible(conversation_id, owner)
        items = [as_item(item) for item in body.items]
        if await self._store.append(conversation_id, items) is None:
            raise _no_conversation(conversation_id)
        return web.json_response({"object": "list", "data": items, "first_id": items[0]["id"],
                                  "last_id": items[-1]["id"], "has_more": False})

    async def get_item(self, request: web.Request) -> web.Response:
        conversation_id, item_id = request.match_info["conversation_id"], request.match_info["item_id"]
        record = await self._visible(conversation_id, self._authorize(request))
        if item_id not in record.item_ids or (item := await self._store.item(conversation_id, item_id)) is None:
            raise _no_item(item_id)
        return web.json_response(item)

    async def delete_item(self, request: web.Request) -> web.Response:
        """OpenAI answers with the conversation the item was removed from."""
        conversation_id, item_id = request.match_info["conversation_id"], request.match_info["item_id"]
        record = await self._visible(conversation_id, self._authorize(request))
        if item_id not in record.item_ids:
            raise _no_item(item_id)
        if (record := await self._store.remove_item(conversation_id, item_id)) is None:
            raise _no_item(item_id)  # removed (or the conversation deleted) meanwhile
        return web.json_response(conversation_object(record))

    # --- /v1/responses with a conversation -------------------------------------------------------
    async def history(self, conversation_id: str, owner: str | None, own: list[dict]) -> list[dict]:
        """The items of the conversation, oldest first, to go before a response's input ``own``
        (which must be new to it: ``check_new_items``); a 404 naming ``conversation`` when
        there is none, or it is another owner's."""
        record = await self._visible(conversation_id, owner, param="conversation")
        check_new_items(record, own, "input")
        return await self._store.items(conversation_id, record.item_ids)

    async def add_turn(self, conversation_id: str, items: list[dict]) -> None:
        """Add a finished response's input and output items; a failure (the conversation deleted
        meanwhile, an item added twice by a racing request) costs the client only those items."""
        try:
            if await self._store.append(conversation_id, items) is None:
                log.info("%s: deleted before the response ended; its items are dropped", conversation_id)
        except Exception:  # noqa: BLE001 — the answer is made: log, and answer it all the same
            log.exception("%s: could not add the response's items", conversation_id)

    # --- owners ----------------------------------------------------------------------------------
    async def _visible(self, conversation_id: str, owner: str | None,
                       param: str = "conversation_id") -> StoredConversation:
        """The conversation; a 404 if there is none or it is another owner's."""
        if (current := await self._store.get(conversation_id)) is None or not owns(owner, current.record.owner):
            raise _no_conversation(conversation_id, param)
        return current.record

    def _authorize(self, request: web.Request) -> str | None:
        """The caller's owner id; a 401 for a bad key."""
        return self._gateway.api_keys.owner(request.headers.get("Authorization"))


def _not_found(message: str, param: str, code: str) -> ApiError:
    # OpenAI reports a missing conversation or item as an invalid request, not as a missing route
    return ApiError(404, message, param=param, code=code, error_type="invalid_request_error")


def _no_conversation(conversation_id: str, param: str = "conversation_id") -> ApiError:
    return _not_found(f"Conversation with id {conversation_id!r} not found.", param, "conversation_not_found")


def _no_item(item_id: str) -> ApiError:
    return _not_found(f"Item with id {item_id!r} not found.", "item_id", "item_not_found")
