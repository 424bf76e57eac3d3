"""OpenAI's Conversations API on a real stack (real SmolLM2, one decode worker, its own NATS and
Redis under a state dir) with API keys, through the official ``openai`` client: turns of
``responses.create(conversation=...)`` (plain, streamed, background) each add their input and
output items, and a turn's prompt is the conversation before it: greedy, its answer and its
``input_tokens`` equal those of the same history sent whole without a conversation. Items are
listed, paged, retrieved and deleted; another key gets 404 for all of it; openai-agents'
``OpenAIConversationsSession`` and ``Runner.run(conversation_id=...)`` keep their history there;
and the conversations outlive a restart of the whole stack."""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest

from services.stack.stack import StackSpec
from stack_helpers import running_stack, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
KEY_A, KEY_B = "sk-conv-a", "sk-conv-b"
GREEDY = {"temperature": 0, "max_output_tokens": 24}
MADE = {"completed", "incomplete"}  # incomplete: cut off at max_output_tokens; its items are added all the same


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """Its own NATS and Redis (none given): ``tandem up``'s nats-server keeps JetStream under the
    state dir, so a second stack on it finds what the first stored."""
    return StackSpec(state_dir=tmp_path_factory.mktemp("conversations"), num_decode=1, model=MODEL, port=0,
                     namespace=f"c{uuid.uuid4().hex[:8]}", gateway_flags={"api_keys": f"{KEY_A},{KEY_B}"},
                     decode_flags={"max_model_len": 1024, "kv_cache_memory": "64MiB", "device": "cpu",
                                   "num_warmup_requests": 1})


@pytest.fixture(scope="module")
def stack(spec):
    with running_stack(spec, ready_timeout_s=180) as s:
        yield s


def client_for(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0, timeout=300)


def items_of(client: openai.OpenAI, conversation_id: str) -> list[dict]:
    """Every item, oldest first, as plain dicts (as an agent sends them back)."""
    return [i.model_dump(exclude_unset=True)
            for i in client.conversations.items.list(conversation_id, order="asc", limit=100)]


def text_of(item: dict) -> str:
    return "".join(part["text"] for part in item["content"])


def stateless(client: openai.OpenAI, history: list[dict], said: str):
    """The same turn with its whole history sent as input, no conversation, nothing stored."""
    return client.responses.create(model=MODEL, input=history + [{"role": "user", "content": said}],
                                   store=False, **GREEDY)


@pytest.fixture(scope="module")
def conversation(stack):
    """Two turns of key A, the second asking about the first: (conversation id, first, second)."""
    a = client_for(stack, KEY_A)
    conv = a.conversations.create(metadata={"suite": "turns"},
                                  items=[{"role": "system", "content": "You are a helpful assistant. Be brief."}])
    assert conv.object == "conversation" and conv.id.startswith("conv_") and conv.metadata == {"suite": "turns"}
    first = a.responses.create(model=MODEL, conversation=conv.id, input="My name is Ada and I live in Oslo.",
                               **GREEDY)
    second = a.responses.create(model=MODEL, conversation={"id": conv.id}, input="What is my name?", **GREEDY)
    return conv.id, first, second


def test_each_turn_adds_its_input_and_output_and_the_next_turn_reads_them(stack, conversation):
    """Over a minute: the module's stack starts here (its warm-up included)."""
    a = client_for(stack, KEY_A)
    conv_id, first, second = conversation
    assert {first.status, second.status} <= MADE and first.conversation.id == second.conversation.id == conv_id
    items = items_of(a, conv_id)
    assert [(i["type"], i["role"]) for i in items] == [("message", "system"), ("message", "user"),
                                                       ("message", "assistant"), ("message", "user"),
                                                       ("message", "assistant")], items
    assert text_of(items[1]) == "My name is Ada and I live in Oslo." and text_of(items[3]) == "What is my name?"
    assert [items[2]["id"], items[4]["id"]] == [first.output[0].id, second.output[0].id]
    assert [text_of(items[2]), text_of(items[4])] == [first.output_text, second.output_text]
    assert all(i["status"] in MADE and i["id"] for i in items)
    # the second prompt held the first turn: what the same history sent whole gets, token for token
    alone = stateless(a, items[:3], "What is my name?")
    assert (second.output_text, second.usage.input_tokens) == (alone.output_text, alone.usage.input_tokens)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    first_alone = stateless(a, items[:1], "My name is Ada and I live in Oslo.")
    assert (first.output_text, first.usage.input_tokens) == (first_alone.output_text, first_alone.usage.input_tokens)
    # the turns were stored responses too, with their own input items
    assert [i.id for i in a.responses.input_items.list(second.id)] == [items[3]["id"]]


def test_streamed_and_background_turns_add_theirs_too(stack, conversation):
    a = client_for(stack, KEY_A)
    conv_id = a.conversations.create(items=[{"role": "user", "content": "Count: one."}]).id
    with a.responses.stream(model=MODEL, conversation=conv_id, input="two.", **GREEDY) as stream:
        streamed = stream.get_final_response()
    assert streamed.status in MADE and streamed.conversation.id == conv_id
    items = items_of(a, conv_id)
    assert len(items) == 3 and items[2]["id"] == streamed.output[0].id
    queued = a.responses.create(model=MODEL, conversation=conv_id, input="three.", background=True, **GREEDY)
    wait_for(lambda: a.responses.retrieve(queued.id).status in MADE, 120, "the background turn")
    after = items_of(a, conv_id)
    assert len(after) == 5 and text_of(after[3]) == "three."
    assert after[4]["id"] == a.responses.retrieve(queued.id).output[0].id
    alone = stateless(a, items, "three.")
    assert text_of(after[4]) == alone.output_text


def test_items_are_listed_retrieved_added_and_deleted(stack, conversation):
    a = client_for(stack, KEY_A)
    conv_id, first, _ = conversation
    ids = [i["id"] for i in items_of(a, conv_id)]
    newest = a.conversations.items.list(conv_id, limit=2)  # desc by default
    assert [i.id for i in newest.data] == ids[::-1][:2] and newest.has_more
    rest = a.conversations.items.list(conv_id, limit=10, after=newest.data[-1].id)
    assert [i.id for i in rest.data] == ids[::-1][2:] and not rest.has_more
    got = a.conversations.items.retrieve(first.output[0].id, conversation_id=conv_id)
    assert got.type == "message" and got.role == "assistant" and got.content[0].text == first.output_text
    added = a.conversations.items.create(conv_id, items=[
        {"type": "function_call", "call_id": "call_9", "name": "lookup", "arguments": "{\"q\": 1}"},
        {"type": "function_call_output", "call_id": "call_9", "output": "found"}])
    assert [i.type for i in added.data] == ["function_call", "function_call_output"]
    assert [i["id"] for i in items_of(a, conv_id)] == ids + [i.id for i in added.data]
    for item in added.data:
        after = a.conversations.items.delete(item.id, conversation_id=conv_id)
        assert after.id == conv_id and after.object == "conversation"
    assert [i["id"] for i in items_of(a, conv_id)] == ids
    with pytest.raises(openai.NotFoundError):
        a.conversations.items.retrieve(added.data[0].id, conversation_id=conv_id)
    with pytest.raises(openai.BadRequestError, match="Mutually exclusive"):
        a.responses.create(model=MODEL, conversation=conv_id, previous_response_id=first.id, input="x", **GREEDY)
    updated = a.conversations.update(conv_id, metadata={"suite": "turns", "n": "2"})
    assert updated.metadata == {"suite": "turns", "n": "2"}


def test_another_key_gets_404_for_a_conversation_and_its_items(stack, conversation):
    a, b = client_for(stack, KEY_A), client_for(stack, KEY_B)
    conv_id, first, _ = conversation
    item_id = first.output[0].id
    for call in (lambda: b.conversations.retrieve(conv_id),
                 lambda: b.conversations.update(conv_id, metadata={}),
                 lambda: b.conversations.delete(conv_id),
                 lambda: b.conversations.items.list(conv_id),
                 lambda: b.conversations.items.create(conv_id, items=[{"role": "user", "content": "x"}]),
                 lambda: b.conversations.items.retrieve(item_id, conversation_id=conv_id),
                 lambda: b.conversations.items.delete(item_id, conversation_id=conv_id),
                 lambda: b.responses.create(model=MODEL, conversation=conv_id, input="hi", **GREEDY)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert a.conversations.retrieve(conv_id).id == conv_id and len(items_of(a, conv_id)) == 5
    deleted = b.conversations.delete(b.conversations.create().id)  # B's own, B deletes
    assert deleted.deleted and deleted.object == "conversation.deleted"


def test_openai_agents_keep_their_history_in_a_conversation(stack):
    import agents  # a declared test dependency: missing, the test fails rather than skips
    from agents import Agent, ModelSettings, OpenAIConversationsSession, OpenAIResponsesModel, Runner

    agents.set_tracing_disabled(True)
    a = client_for(stack, KEY_A)

    async def main() -> tuple[str, str]:  # one event loop: the client's connections belong to it
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=300)
        # openai-agents fails a run on an incomplete response: room enough for the model to end its answer
        agent = Agent(name="helper", instructions="Answer in one short sentence.",
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=400))
        session = OpenAIConversationsSession(openai_client=client)
        first = await Runner.run(agent, "My name is Ada.", session=session)
        second = await Runner.run(agent, "What is my name?", session=session)
        kept = await session.get_items()
        assert [i["role"] for i in kept] == ["user", "assistant", "user", "assistant"], kept
        assert (first.raw_responses[0].usage.input_tokens + first.raw_responses[0].usage.output_tokens
                < second.raw_responses[0].usage.input_tokens)  # the first turn was in the second's prompt
        popped = await session.pop_item()
        assert popped["role"] == "assistant" and len(await session.get_items()) == 3
        session_id = session.session_id
        await session.clear_session()
        # the server keeps the conversation instead: Runner sends only the new items with it
        conv_id = (await client.conversations.create()).id
        await Runner.run(agent, "My name is Ada.", conversation_id=conv_id)
        await Runner.run(agent, "What is my name?", conversation_id=conv_id)
        return session_id, conv_id

    session_id, conv_id = asyncio.run(main())
    with pytest.raises(openai.NotFoundError):
        a.conversations.retrieve(session_id)
    items = items_of(a, conv_id)
    assert [i["role"] for i in items] == ["user", "assistant", "user", "assistant"], items
    assert text_of(items[2]) == "What is my name?"


def test_conversations_outlive_a_restart_of_the_whole_stack(stack, spec, conversation):
    """Over a minute: the whole stack stops and a second one starts on its state dir."""
    conv_id = conversation[0]
    before = items_of(client_for(stack, KEY_A), conv_id)
    stack.stop()
    with running_stack(spec, ready_timeout_s=180) as again:
        a, b = client_for(again, KEY_A), client_for(again, KEY_B)
        assert a.conversations.retrieve(conv_id).metadata["suite"] == "turns"
        assert items_of(a, conv_id) == before
        third = a.responses.create(model=MODEL, conversation=conv_id, input="Where do I live?", **GREEDY)
        assert third.status in MADE and len(items_of(a, conv_id)) == len(before) + 2
        assert third.usage.input_tokens == stateless(a, before, "Where do I live?").usage.input_tokens
        with pytest.raises(openai.NotFoundError):
            b.conversations.retrieve(conv_id)
