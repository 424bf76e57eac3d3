"""Conversations (OpenAI's Conversations API) on a real nats-server, no model: the store (a
conversation written through one connection is read through another, as another gateway would;
items keep their order, compare-and-set lets two writers both land, a delete takes the items
along, ids that cannot be keys read as missing) and the gateway's ``/v1/conversations`` endpoints
in process (OpenAI's object shapes, paging, 400s and 404s in OpenAI's error format, another API
key's conversation a 404, ``conversation`` on ``/v1/responses`` refused with
``previous_response_id`` and a 404 when unknown, and a response that fails adding nothing)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.config import GatewaySettings
from services.gateway.service import Gateway, build_app
from shared.bus import Bus, WorkerRegistry
from shared.openai_api.errors import ApiError
from shared.openai_api.stored.conversation_store import ConversationStore
from shared.openai_api.stored.conversations import MAX_ITEMS, check_new_items, new_conversation
from shared.openai_api.stored.store import ResponseStore
from shared.protocol import StoredConversation, StoredConversationItem, Subjects

KEY_A, KEY_B = "sk-conv-a", "sk-conv-b"


def message(item_id: str, text: str, role: str = "user") -> dict:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"id": item_id, "type": "message", "role": role, "status": "completed",
            "content": [{"type": kind, "text": text}]}


@pytest.fixture
async def store(bus, namespace):
    return await ConversationStore.open(bus, Subjects(namespace))


def test_the_wire_records_survive_a_json_round_trip():
    record = StoredConversation(id="conv_1", created_at=5, metadata={"k": "v"}, item_ids=("msg_1", "x y"),
                                owner="key_a")
    item = StoredConversationItem(id="msg_1", conversation_id="conv_1", item=json.dumps(message("msg_1", "hi")))
    assert StoredConversation.from_bytes(record.to_bytes()) == record
    assert StoredConversationItem.from_bytes(item.to_bytes()) == item
    assert StoredConversation.from_bytes(b'{"id": "conv_2", "created_at": 1}').item_ids == ()


def test_new_items_are_refused_when_already_there_twice_too_large_or_too_many():
    record = new_conversation({"a": "b"}, None).model_copy(update={"item_ids": ("msg_1",)})
    check_new_items(record, [message("msg_2", "new")], "items")
    for items, param, code in (([message("msg_1", "again")], "items[0].id", "duplicate_item"),
                               ([message("m", "x"), message("m", "y")], "items[1].id", "duplicate_item"),
                               ([message("m", "x" * (800 << 10))], "items[0]", "input_too_large")):
        with pytest.raises(ApiError) as info:
            check_new_items(record, items, "items")
        assert (info.value.status, info.value.param, info.value.code) == (400, param, code)
    full = record.model_copy(update={"item_ids": tuple(f"m{i}" for i in range(MAX_ITEMS))})
    with pytest.raises(ApiError, match="at most"):
        check_new_items(full, [message("one_more", "x")], "items")


async def test_a_second_connection_reads_what_the_first_wrote_in_order(store, nats_url, namespace):
    record = await store.create(new_conversation({"topic": "x"}, "key_a"),
                                [message("msg_a", "first"), message("weird id/with.dots", "second")])
    assert record.item_ids == ("msg_a", "weird id/with.dots")
    other_bus = await Bus.connect(nats_url, "other-gateway")
    try:
        other = await ConversationStore.open(other_bus, Subjects(namespace))
        found = (await other.get(record.id)).record
        assert found == record and found.owner == "key_a" and found.metadata == {"topic": "x"}
        await other.append(record.id, [message("msg_c", "third", "assistant")])
        ids = (await store.get(record.id)).record.item_ids
        assert [i["content"][0]["text"] for i in await store.items(record.id, ids)] == ["first", "second", "third"]
        assert (await store.item(record.id, "weird id/with.dots"))["content"][0]["text"] == "second"
        assert await store.item(record.id, "msg_nope") is None
    finally:
        await other_bus.close()


async def test_two_writers_at_once_both_land_and_a_duplicate_is_refused(store):
    record = await store.create(new_conversation(None, None), [])
    await asyncio.gather(*(store.append(record.id, [message(f"msg_{w}_{i}", f"{w}{i}") for i in range(3)])
                           for w in "abcd"))
    ids = (await store.get(record.id)).record.item_ids
    assert sorted(ids) == sorted(f"msg_{w}_{i}" for w in "abcd" for i in range(3))
    for w in "abcd":  # each writer's items stay together, in its order
        mine = [i for i in ids if i.startswith(f"msg_{w}_")]
        assert mine == [f"msg_{w}_{i}" for i in range(3)] and ids.index(mine[2]) - ids.index(mine[0]) == 2
    with pytest.raises(ApiError, match="Duplicate item"):
        await store.append(record.id, [message("msg_a_0", "again")])
    assert len((await store.get(record.id)).record.item_ids) == 12


async def test_metadata_removal_and_delete_take_effect_and_bad_ids_read_as_missing(store, bus, namespace):
    record = await store.create(new_conversation({"a": "1"}, None), [message("msg_1", "x"), message("msg_2", "y")])
    assert (await store.set_metadata(record.id, {"b": "2"})).metadata == {"b": "2"}
    assert (await store.remove_item(record.id, "msg_1")).item_ids == ("msg_2",)
    assert await store.remove_item(record.id, "msg_1") is None and await store.item(record.id, "msg_1") is None
    assert await store.delete(record.id) and not await store.delete(record.id)
    assert await store.get(record.id) is None and await store.append(record.id, [message("m", "x")]) is None
    assert await store.set_metadata(record.id, {}) is None
    bucket = await bus.key_value(Subjects(namespace).conversations_bucket)
    assert await bucket.items_under(f"i.{record.id}") == []  # the items went with it
    for bad in ("a.b", "x y", "", "c" * 65, "../x", "*", ">"):
        assert await store.get(bad) is None and not await store.delete(bad) and await store.item(bad, "m") is None


# --- the HTTP API, in process --------------------------------------------------------------------

@pytest.fixture
async def http(bus, nats_url, namespace):
    """A gateway (no tokenizer, no workers: nothing here generates) with keys A and B."""
    subjects = Subjects(namespace)
    registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=5.0)
    gateway = Gateway(GatewaySettings(nats_url=nats_url, namespace=namespace, api_keys=f"{KEY_A},{KEY_B}",
                                      model="smollm2-135m"),
                      bus, registry, None, responses=await ResponseStore.open(bus, subjects, ttl_s=3600.0),
                      conversations=await ConversationStore.open(bus, subjects))
    client = TestClient(TestServer(build_app(gateway)))
    await client.start_server()

    async def call(method: str, path: str, key: str = KEY_A, **kwargs) -> tuple[int, dict]:
        resp = await client.request(method, path, headers={"Authorization": f"Bearer {key}"}, **kwargs)
        return resp.status, await resp.json()

    yield call
    await client.close()


async def test_conversations_and_their_items_as_openai_answers(http):
    status, conv = await http("POST", "/v1/conversations", json={
        "metadata": {"topic": "demo"},
        "items": [{"type": "message", "role": "user", "content": "Hello!"},
                  {"role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
                  {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "42", "id": "fco_mine"}]})
    assert status == 200, conv
    assert set(conv) == {"id", "object", "created_at", "metadata"} and conv["object"] == "conversation"
    assert conv["id"].startswith("conv_") and conv["metadata"] == {"topic": "demo"}
    cid = conv["id"]
    assert await http("GET", f"/v1/conversations/{cid}") == (200, conv)

    status, page = await http("GET", f"/v1/conversations/{cid}/items", params={"order": "asc"})
    items = page["data"]
    assert [i["type"] for i in items] == ["message", "message", "function_call", "function_call_output"]
    assert items[0]["id"].startswith("msg_") and items[0]["role"] == "user" and items[0]["status"] == "completed"
    assert items[0]["content"] == [{"type": "input_text", "text": "Hello!"}]
    assert items[1]["content"][0]["type"] == "output_text" and items[3]["id"] == "fco_mine"
    assert page["first_id"] == items[0]["id"] and page["last_id"] == items[-1]["id"] and not page["has_more"]

    # newest first by default; limit and after page through
    status, newest = await http("GET", f"/v1/conversations/{cid}/items", params={"limit": "3"})
    assert [i["id"] for i in newest["data"]] == [i["id"] for i in items[::-1][:3]] and newest["has_more"]
    status, rest = await http("GET", f"/v1/conversations/{cid}/items", params={
        "limit": "3", "after": newest["last_id"], "include": "message.output_text.logprobs"})
    assert [i["id"] for i in rest["data"]] == [items[0]["id"]] and not rest["has_more"]

    status, added = await http("POST", f"/v1/conversations/{cid}/items",
                               json={"items": [{"role": "user", "content": "More?"}]})
    assert status == 200 and added["object"] == "list" and len(added["data"]) == 1, added
    new_id = added["data"][0]["id"]
    assert await http("GET", f"/v1/conversations/{cid}/items/{new_id}") == (200, added["data"][0])
    assert await http("DELETE", f"/v1/conversations/{cid}/items/{new_id}") == (200, conv)
    status, error = await http("GET", f"/v1/conversations/{cid}/items/{new_id}")
    assert status == 404 and error["error"]["code"] == "item_not_found", error

    status, updated = await http("POST", f"/v1/conversations/{cid}", json={"metadata": {"topic": "new", "x": "y"}})
    assert status == 200 and updated == {**conv, "metadata": {"topic": "new", "x": "y"}}
    assert await http("DELETE", f"/v1/conversations/{cid}") == \
        (200, {"id": cid, "object": "conversation.deleted", "deleted": True})
    for method, path in (("GET", f"/v1/conversations/{cid}"), ("GET", f"/v1/conversations/{cid}/items"),
                         ("DELETE", f"/v1/conversations/{cid}")):
        status, error = await http(method, path)
        assert status == 404 and error["error"]["code"] == "conversation_not_found", (method, path, error)
        assert error["error"]["type"] == "invalid_request_error" and cid in error["error"]["message"]

    status, empty = await http("POST", "/v1/conversations", data=b"")  # no body: an empty conversation
    assert status == 200 and empty["metadata"] == {}
    status, page = await http("GET", f"/v1/conversations/{empty['id']}/items")
    assert page == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


async def test_another_key_gets_404_for_everything(http):
    status, conv = await http("POST", "/v1/conversations", json={"items": [{"role": "user", "content": "secret"}]})
    cid = conv["id"]
    item_id = (await http("GET", f"/v1/conversations/{cid}/items"))[1]["data"][0]["id"]
    for method, path, body in (("GET", f"/v1/conversations/{cid}", None),
                               ("POST", f"/v1/conversations/{cid}", {"metadata": {}}),
                               ("DELETE", f"/v1/conversations/{cid}", None),
                               ("GET", f"/v1/conversations/{cid}/items", None),
                               ("POST", f"/v1/conversations/{cid}/items", {"items": [{"role": "user",
                                                                                     "content": "x"}]}),
                               ("GET", f"/v1/conversations/{cid}/items/{item_id}", None),
                               ("DELETE", f"/v1/conversations/{cid}/items/{item_id}", None),
                               ("POST", "/v1/responses", {"input": "hi", "conversation": cid})):
        status, error = await http(method, path, KEY_B, json=body)
        assert status == 404 and error["error"]["code"] == "conversation_not_found", (method, path, error)
    status, error = await http("GET", f"/v1/conversations/{cid}", "sk-unknown")
    assert status == 401, error
    status, page = await http("GET", f"/v1/conversations/{cid}/items")  # A's is as it was
    assert status == 200 and [i["id"] for i in page["data"]] == [item_id]


async def test_bad_bodies_are_400s_naming_the_parameter(http):
    cid = (await http("POST", "/v1/conversations", json={}))[1]["id"]
    too_many = [{"role": "user", "content": str(i)} for i in range(21)]
    for method, path, body, param in (
            ("POST", "/v1/conversations", {"items": too_many}, "items"),
            ("POST", "/v1/conversations", {"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
            ("POST", "/v1/conversations", {"metadata": {"k": "v" * 513}}, "metadata.k"),
            ("POST", "/v1/conversations", {"nonsense": 1}, "nonsense"),
            ("POST", "/v1/conversations", {"items": [{"role": "user", "content": [
                {"type": "input_image", "image_url": "http://x"}]}]}, "items[0].content[0]"),
            ("POST", f"/v1/conversations/{cid}/items", {"items": []}, "items"),
            ("POST", f"/v1/conversations/{cid}/items", {"items": too_many}, "items"),
            ("POST", f"/v1/conversations/{cid}/items", {"items": [{"type": "reasoning", "summary": []}]}, "items.0"),
            ("POST", f"/v1/conversations/{cid}", {}, "metadata"),
            ("POST", "/v1/responses", {"input": "hi", "conversation": cid, "previous_response_id": "resp_1"}, None),
            ("POST", "/v1/responses", {"input": "hi", "conversation": {"id": cid, "x": 1}}, "conversation")):
        status, error = await http(method, path, json=body)
        assert status == 400 and error["error"]["type"] == "invalid_request_error", (body, error)
        assert error["error"]["param"] == param or (param and error["error"]["param"].startswith(param)), (body, error)
    status, error = await http("POST", "/v1/responses", json={"input": "hi", "conversation": cid,
                                                              "previous_response_id": "resp_1"})
    assert error["error"]["code"] == "mutually_exclusive_parameters", error
    status, error = await http("GET", f"/v1/conversations/{cid}/items", params={"order": "sideways"})
    assert status == 400 and error["error"]["param"] == "order"
    status, error = await http("GET", f"/v1/conversations/{cid}/items", params={"limit": "101"})
    assert status == 400 and error["error"]["param"] == "limit"
    status, added = await http("POST", f"/v1/conversations/{cid}/items", json={"items": [
        {"role": "user", "content": "x", "id": "msg_mine"}]})
    assert status == 200
    status, error = await http("POST", f"/v1/conversations/{cid}/items", json={"items": [
        {"role": "user", "content": "again", "id": "msg_mine"}]})
    assert status == 400 and error["error"]["code"] == "duplicate_item", error
    status, error = await http("POST", "/v1/responses", json={"input": [
        {"role": "user", "content": "again", "id": "msg_mine"}], "conversation": {"id": cid}})
    assert status == 400 and error["error"]["param"] == "input[0].id", error
    for unknown in ("conv_nope", "a.b"):
        status, error = await http("POST", "/v1/responses", json={"input": "hi", "conversation": unknown})
        assert status == 404 and error["error"]["param"] == "conversation", error


async def test_a_response_that_fails_adds_nothing_to_its_conversation(http):
    cid = (await http("POST", "/v1/conversations", json={"items": [{"role": "user", "content": "x"}]}))[1]["id"]
    status, error = await http("POST", "/v1/responses", json={"input": "hi", "conversation": cid})
    assert status >= 400 and "error" in error  # no worker, no admission: it cannot run
    status, page = await http("GET", f"/v1/conversations/{cid}/items")
    assert len(page["data"]) == 1
