"""The stored-responses store on a real nats-server (no model): a response stored by one
connection is read by another (another gateway), a conversation is rebuilt across turns, a
compare-and-set loses to a change made meanwhile, a delete breaks the chain with the missing turn
named, ids that cannot be keys read as missing, a conversation is walked only through its
owner's turns, and the bucket expires entries after its TTL."""

from __future__ import annotations

import json

import pytest

from shared.bus import Bus
from shared.openai_api.stored.store import ResponseNotFound, ResponseStore
from shared.protocol import Subjects
from shared.protocol.responses import StoredResponse

TTL_S = 3600.0


def turn(response_id: str, previous: str | None, said: str, answered: str, status: str = "completed") -> StoredResponse:
    output = [{"id": f"msg_o{response_id}", "type": "message", "role": "assistant", "status": status,
               "content": [{"type": "output_text", "text": answered, "annotations": []}]}]
    items = [{"id": f"msg_i{response_id}", "type": "message", "role": "user",
              "content": [{"type": "input_text", "text": said}]}]
    response = {"id": response_id, "object": "response", "status": status, "output": output}
    return StoredResponse(id=response_id, created_at=1, status=status, response=json.dumps(response),
                          input_items=json.dumps(items), previous_response_id=previous)


@pytest.fixture
async def store(bus, namespace):
    return await ResponseStore.open(bus, Subjects(namespace), ttl_s=TTL_S)


async def test_a_second_connection_reads_the_conversation_the_first_stored(store, nats_url, namespace):
    await store.create(turn("resp_1", None, "hi", "hello"))
    await store.create(turn("resp_2", "resp_1", "again", "yes"))
    with pytest.raises(RuntimeError):
        await store.create(turn("resp_2", "resp_1", "twice", "no"))
    other_bus = await Bus.connect(nats_url, "other-gateway")
    try:
        other = await ResponseStore.open(other_bus, Subjects(namespace), ttl_s=1.0)  # the bucket keeps its TTL
        last, items = await other.conversation("resp_2")
        assert last.id == "resp_2" and last.previous_response_id == "resp_1"
        assert [i["id"] for i in items] == ["msg_iresp_1", "msg_oresp_1", "msg_iresp_2", "msg_oresp_2"]
        assert await (await other_bus.key_value(Subjects(namespace).responses_bucket)).ttl_s() == TTL_S
    finally:
        await other_bus.close()


async def test_compare_and_set_delete_and_ids_that_cannot_be_keys(store):
    await store.create(turn("resp_a", None, "hi", "", status="in_progress"))
    await store.create(turn("resp_b", "resp_a", "and", "then"))
    first = await store.get("resp_a")
    assert first.record.status == "in_progress" and not first.record.is_final
    done = await store.replace(first, turn("resp_a", None, "hi", "hello"))
    assert done.record.is_final and done.revision > first.revision
    assert await store.replace(first, turn("resp_a", None, "hi", "stale")) is None  # changed since `first`
    assert json.loads((await store.get("resp_a")).record.response)["output"][0]["content"][0]["text"] == "hello"
    assert await store.delete("resp_a") and not await store.delete("resp_a")
    assert await store.get("resp_a") is None
    with pytest.raises(ResponseNotFound) as info:
        await store.conversation("resp_b")
    assert info.value.response_id == "resp_a"
    for bad in ("a.b", "x y", "", "r" * 65, "../x"):
        assert await store.get(bad) is None and not await store.delete(bad)


async def test_a_conversation_is_its_owners_only(store):
    await store.create(turn("resp_o1", None, "hi", "hello").model_copy(update={"owner": "key_a"}))
    await store.create(turn("resp_o2", "resp_o1", "again", "yes").model_copy(update={"owner": "key_a"}))
    await store.create(turn("resp_o3", "resp_o2", "mine?", "no").model_copy(update={"owner": "key_b"}))
    last, items = await store.conversation("resp_o2", "key_a")
    assert last.owner == "key_a" and len(items) == 4
    assert len((await store.conversation("resp_o2"))[1]) == 4  # no owner given (no API keys): every turn
    for response_id, owner, missing in (("resp_o2", "key_b", "resp_o2"), ("resp_o3", "key_b", "resp_o2"),
                                        ("resp_o3", "key_a", "resp_o3")):
        with pytest.raises(ResponseNotFound) as info:
            await store.conversation(response_id, owner)
        assert info.value.response_id == missing
    # a record stored before owners were recorded loads, as the anonymous owner's
    legacy = json.loads(turn("resp_old", None, "hi", "hello").to_bytes())
    del legacy["owner"]
    assert StoredResponse.from_bytes(json.dumps(legacy).encode()).owner is None
