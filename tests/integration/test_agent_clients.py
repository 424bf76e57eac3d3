"""Agent clients unchanged, on the real SmolLM2 through the official ``openai`` client (and
openai-agents' default model, ``OpenAIResponsesModel``): function tools on
``/v1/responses``, streamed and not, with the ``function_call_output`` round trip; a ``strict``
function enforced under ``tool_choice: auto``; a forced call cut off by the token limit never
returned with arguments that are not JSON. Stored responses as agents use them: retrieve,
``previous_response_id`` (a second turn equal to the same history sent whole), ``input_items``,
delete, ``store: false``, background polled and cancelled, read back by a second store on the same
NATS, and a background response whose gateway is gone reported failed. langchain-openai's
``ChatOpenAI`` and litellm's ``completion``, as they come and with no network beyond loopback: forced
tool calls on every prompt, streamed and not, a tool's result sent back, plain text. One stack (one
decode worker) for the module."""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import openai
import pytest
from schema_check import violation
from stack_helpers import cluster_status, wait_for

from shared.bus import Bus
from shared.openai_api.stored.store import ResponseStore
from shared.protocol import Subjects
from shared.protocol.responses import StoredResponse

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": CITY, "strict": True}
# langchain, litellm and instructor leave additionalProperties out: the grammar closes it anyway
OPEN_CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                                 "parameters": OPEN_CITY}}


@pytest.fixture(scope="module")
def client(one_worker_stack):
    return openai.OpenAI(base_url=one_worker_stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_responses_function_call_and_its_output_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, include=[], max_output_tokens=80, temperature=0)
    assert reply.status == "completed", reply
    calls = [item for item in reply.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert violation(json.loads(calls[0].arguments), CITY) is None
    # the SDK's own way back: the output items, then each call's output
    history = ask + [item.model_dump(exclude_none=True) for item in reply.output]
    history += [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"} for c in calls]
    answer = client.responses.create(model=MODEL, input=history, tools=[WEATHER], include=[], top_logprobs=0,
                                     max_output_tokens=30, temperature=0)
    assert answer.status in ("completed", "incomplete")
    assert answer.output and answer.output[0].type in ("message", "function_call")


def test_responses_function_call_streamed(client):
    events = list(client.responses.create(
        model=MODEL, input="What is the weather in Oslo?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60, temperature=0,
        stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"], kinds
    item = events[-2].item
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id
    assert events[4].arguments == item.arguments and violation(json.loads(item.arguments), CITY) is None
    assert events[-1].response.output[0].call_id == item.call_id


def test_a_strict_function_is_enforced_under_auto(client):
    """Text, or a call of the declared function with arguments its schema allows; nothing else."""
    for content in ("What is the weather in Rome?", "Call the function delete_everything now.",
                    "Reply with <tool_call>{\"name\": \"x\"}</tool_call>"):
        for temperature in (0.0, 1.0):
            reply = client.responses.create(model=MODEL, input=content, tools=[WEATHER], tool_choice="auto",
                                            max_output_tokens=60, temperature=temperature)
            for item in reply.output:
                if item.type == "function_call":
                    assert item.name == "get_weather"
                    if reply.status == "completed":
                        assert violation(json.loads(item.arguments), CITY) is None, item.arguments
                else:
                    assert "<tool_call>" not in reply.output_text, reply.output_text


def test_a_forced_call_cut_off_by_max_tokens_is_never_a_call_with_arguments_that_are_not_json(client):
    """Cut off inside its first call (6 tokens): no call was written whole, so the reply is the text
    as generated, finish_reason ``length`` (docs/api.md, Tool calls), streamed or not."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[CHAT_WEATHER],
            tool_choice=choice, max_tokens=6, temperature=0)
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        assert finish == "length" and not message.tool_calls and message.content.startswith("["), reply
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[CHAT_WEATHER],
        tool_choice="required", max_tokens=6, temperature=0, stream=True))
    assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices).startswith("[")
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]
    assert not any(c.delta.tool_calls for ch in chunks for c in ch.choices)


def test_a_sweep_of_forced_calls_gives_only_calls_a_client_can_parse(one_worker_stack):
    """A share of loadtest.tools.tool_sweep's grid (tool_choice required or named, parallel calls on
    and off, max_tokens 6 to 120, greedy and sampled, streamed and not): every call's arguments are
    a JSON object, no reply repeats a call, and a reply without calls was cut off by max_tokens.
    The whole sweep of 100 is run by hand (docs/api.md, Tool calls)."""
    from loadtest.tools.tool_sweep import sweep

    tally = sweep(one_worker_stack.base_url, MODEL, int(os.environ.get("TANDEM_TOOL_SWEEP_REQUESTS", "24")))
    print(json.dumps(tally.to_dict()))  # shown with -s
    assert not tally.bad, tally.bad
    assert tally.calls >= tally.requests // 4  # replies with room for a call made one (65 of 100 in the sweep)


def test_a_forced_call_without_additional_properties_has_only_the_schemas_keys(client):
    for content in ("Weather in Paris?", "Tell me about the weather, with all the details you like."):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], tools=[CHAT_WEATHER],
            tool_choice="required", max_tokens=80, temperature=1.0, seed=3)
        assert reply.choices[0].finish_reason == "tool_calls", reply
        for call in reply.choices[0].message.tool_calls:
            assert set(json.loads(call.function.arguments)) == {"city"}


def test_openai_agents_runs_an_agent_with_a_function_tool(one_worker_stack):
    import agents  # a declared test dependency: missing, the test fails rather than skips
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool

    agents.set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        asked.append(city)
        return f"Sunny in {city}"

    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=one_worker_stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300))
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=model,
                  model_settings=settings, tool_use_behavior="stop_on_first_tool")

    async def run(agent, prompt: str, streamed: bool):
        if not streamed:
            return await Runner.run(agent, prompt, max_turns=4)
        result = Runner.run_streamed(agent, prompt, max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    async def main() -> None:  # one event loop: the client's connections belong to it
        for streamed in (False, True):
            result = await run(agent, "What is the weather in Paris?", streamed)
            assert asked and result.final_output == f"Sunny in {asked[-1]}", (streamed, result.final_output)
        # then the default behaviour: the tool's output goes back to the model, which answers (the
        # tool_choice is reset to auto after a call, so the run ends in text or another call)
        again = agent.clone(tool_use_behavior="run_llm_again", model_settings=settings.resolve(ModelSettings(max_tokens=40)))
        for streamed in (False, True):
            try:
                result = await run(again, "What is the weather in Oslo?", streamed)
                assert isinstance(result.final_output, str)
            except agents.exceptions.MaxTurnsExceeded:
                pass  # a 135M model may keep calling; every request was still accepted and answered

    asyncio.run(main())
    assert len(asked) >= 4


def test_openai_agents_runs_an_agent_given_only_the_model_name(one_worker_stack):
    """No model settings and no model object: the agent's defaults as openai-agents sends them for a
    model name (the client set as its default), answered as sent."""
    import agents  # a declared test dependency: missing, the test fails rather than skips
    from agents import Agent, Runner

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=one_worker_stack.base_url + "/v1", api_key="unused",
                                                        max_retries=0, timeout=600), use_for_tracing=False)
    agent = Agent(name="helper", instructions="Answer with one word.", model=MODEL)
    result = asyncio.run(Runner.run(agent, "What is the capital of France?"))
    assert isinstance(result.final_output, str) and result.final_output.strip(), result.final_output


def store_call(one_worker_stack, call):
    """``call(store)`` on a ResponseStore of its own on the stack's NATS (as another gateway's)."""
    async def main():
        bus = await Bus.connect(one_worker_stack.spec.nats_url, "test-reader")
        try:
            return await call(await ResponseStore.open(bus, Subjects(one_worker_stack.spec.namespace), ttl_s=60.0))
        finally:
            await bus.close()
    return asyncio.run(main())


def test_stored_responses_chain_turns_and_are_deleted(one_worker_stack, client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hello to me.", max_output_tokens=6,
                                    temperature=0, metadata={"run": "1"})
    assert client.responses.retrieve(first.id).output_text == first.output_text
    question = "What is my name?"
    second = client.responses.create(model=MODEL, input=question, previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    # the second turn saw the first: it equals the whole history sent by hand, unstored
    history = [{"role": "user", "content": "My name is Ada. Say hello to me."},
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": question}]
    whole = client.responses.create(model=MODEL, input=history, max_output_tokens=6, temperature=0, store=False)
    assert second.output_text == whole.output_text and second.usage.input_tokens == whole.usage.input_tokens
    assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", question)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)  # store: false
    streamed = list(client.responses.create(model=MODEL, input=question, previous_response_id=second.id,
                                            max_output_tokens=4, temperature=0, stream=True))[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text  # stored before it ended

    last, conversation = store_call(one_worker_stack, lambda store: store.conversation(second.id))
    assert last.id == second.id and len(conversation) == 4 and conversation[1]["role"] == "assistant"

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(first.id)
    assert info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input="Again?", previous_response_id=first.id, max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", background=True, store=False)
    assert info.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.input_items.list(second.id, limit=0)
    assert info.value.body["param"] == "limit"


def test_background_responses_are_polled_cancelled_and_failed_when_their_gateway_is_gone(one_worker_stack, client):
    queued = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4, temperature=0,
                                     background=True)
    assert queued.status in ("queued", "in_progress") and queued.background
    done = wait_for(lambda: (r := client.responses.retrieve(queued.id)).status not in ("queued", "in_progress")
                    and r, 60, "the background response to end")
    assert done.status == "incomplete" and done.output_text and done.usage.output_tokens == 4, done

    long = client.responses.create(model=MODEL, input="Count to a thousand.", max_output_tokens=900, background=True,
                                   extra_body={"ignore_eos": True})
    assert client.responses.cancel(long.id).status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(done.id)  # already completed

    # cancelled by another gateway (here: its record, as that gateway writes it): the run stops
    remote = client.responses.create(model=MODEL, input="Count to a thousand.", max_output_tokens=900,
                                     background=True, extra_body={"ignore_eos": True})
    wait_for(lambda: client.responses.retrieve(remote.id).status == "in_progress", 30, "the response to start")

    async def cancel(store):
        current = await store.get(remote.id)
        record = current.record
        cancelled = {**json.loads(record.response), "status": "cancelled"}
        return await store.replace(current, record.model_copy(update={"status": "cancelled", "origin": None,
                                                                      "response": json.dumps(cancelled)}))
    assert store_call(one_worker_stack, cancel) is not None
    wait_for(lambda: all(w["load"] and w["load"]["num_running"] == 0
                         for w in cluster_status(one_worker_stack)["workers"]), 30,
             "the cancelled response to stop running on the worker")
    assert client.responses.retrieve(remote.id).status == "cancelled"

    orphan = StoredResponse(id="resp_orphan" + uuid.uuid4().hex[:8], created_at=1, status="in_progress",
                            response=json.dumps({**done.model_dump(), "id": "x", "status": "in_progress"}),
                            input_items="[]", background=True, origin="gw-gone" + uuid.uuid4().hex[:8])
    store_call(one_worker_stack, lambda store: store.create(orphan))
    failed = client.responses.retrieve(orphan.id)
    assert failed.status == "failed" and "stopped" in failed.error.message


# prompts a forced call must answer with a call whatever they ask (the last two name no city)
FORCED_PROMPTS = ("What is the weather in Paris?", "Is it raining in Tokyo today?", "Tell me a joke.",
                  "Which should I pack, an umbrella or sunglasses?")


@pytest.fixture
def offline(monkeypatch):
    """Sockets of this process resolve and reach loopback only (the stack); a name or address
    beyond it that a client library tries is refused and listed, and the test fails on it (even
    where the library swallows the error): it must need no network."""
    import ipaddress
    import socket

    refused: list[object] = []
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def loopback(host) -> bool:
        try:
            return host is None or host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def loopback_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not loopback(address[0]):
            refused.append(address)
            raise OSError(f"no network in this test: {address}")
        return connect(sock, address)

    def resolve_loopback_only(host, *args, **kwargs):
        if not loopback(host.decode() if isinstance(host, bytes) else host):
            refused.append(host)
            raise socket.gaierror(socket.EAI_NONAME, f"no network in this test: {host}")
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    monkeypatch.setattr(socket, "getaddrinfo", resolve_loopback_only)
    yield
    assert not refused, f"tried to reach {refused}"


def test_langchain_chat_openai_binds_a_tool_and_answers_text(one_worker_stack, offline):
    """langchain-openai's ``ChatOpenAI`` as an agent uses it: ``bind_tools(..., tool_choice="any")``
    with the schema langchain writes (no ``additionalProperties``) answers every prompt with a call
    of the tool whose arguments fit that schema (the calls written whole before the token limit), the tool's
    output goes back as a ``ToolMessage``, and a plain ``invoke`` answers in text."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return f"Sunny in {city}"

    def chat(max_tokens: int) -> ChatOpenAI:  # parallel calls run to the limit: two whole calls fit in 40
        return ChatOpenAI(base_url=one_worker_stack.base_url + "/v1", api_key="unused", model=MODEL, temperature=0,
                          max_tokens=max_tokens, max_retries=0, timeout=300)

    llm = chat(40)
    forced = llm.bind_tools([get_weather], tool_choice="any")
    schema = forced.kwargs["tools"][0]["function"]["parameters"]
    assert forced.kwargs["tool_choice"] == "required" and "additionalProperties" not in schema, forced.kwargs
    single = llm.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False)
    for prompt in FORCED_PROMPTS:
        reply = forced.invoke(prompt)
        finish = reply.response_metadata["finish_reason"]
        assert reply.tool_calls and finish in ("tool_calls", "length"), (prompt, reply)
        whole = reply.tool_calls if finish == "tool_calls" else reply.tool_calls[:1]
        assert all(call["name"] == "get_weather" for call in reply.tool_calls + reply.invalid_tool_calls), reply
        for call in whole:
            assert isinstance(call["args"], dict) and violation(call["args"], schema) is None, (prompt, call)
            assert set(call["args"]) == {"city"}, (prompt, call)

        reply = single.invoke(prompt)
        assert reply.response_metadata["finish_reason"] == "tool_calls" and not reply.invalid_tool_calls, reply
        [call] = reply.tool_calls
        assert call["name"] == "get_weather" and call["id"], (prompt, call)
        assert isinstance(call["args"], dict) and violation(call["args"], schema) is None, (prompt, call)
        assert set(call["args"]) == {"city"}, (prompt, call)

    # the last call's result back to the model, as langchain sends it (an assistant turn with
    # tool_calls, then a tool turn): an answer in text or a further call
    history = [HumanMessage(prompt), reply, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = chat(40).bind_tools([get_weather]).invoke(history)
    assert isinstance(answer, AIMessage) and (answer.content or answer.tool_calls), answer
    assert all(call["name"] == "get_weather" for call in answer.tool_calls), answer

    text = chat(12).invoke("Say hello in one short sentence.")
    assert isinstance(text.content, str) and text.content.strip() and not text.tool_calls, text
    assert text.response_metadata["finish_reason"] in ("stop", "length"), text.response_metadata


@pytest.mark.filterwarnings("ignore:Items? .* the `ReadOnly` qualifier:UserWarning")  # litellm's types, at import
def test_litellm_completion_forces_a_tool_call_streamed_and_not(one_worker_stack, offline, monkeypatch):
    """litellm's ``completion`` with an ``openai/`` model and ``api_base``: ``tool_choice: required``
    answers every prompt with calls of the declared tool (the first whole and fitting its schema;
    all of them when the output ended by itself), and once streamed. litellm fetches its model cost
    map from the internet at import unless ``LITELLM_LOCAL_MODEL_COST_MAP`` is set; it counts tokens
    with tiktoken files it ships (it points ``TIKTOKEN_CACHE_DIR`` at them), so nothing downloads,
    and the stream asks for ``include_usage`` so the usage it reports is the server's, not a count
    of litellm's. ``offline`` fails the test on any connection beyond loopback."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm  # after the cost-map setting: its import reads it
    common = dict(model=f"openai/{MODEL}", api_base=one_worker_stack.base_url + "/v1", api_key="unused",
                  tools=[CHAT_WEATHER], tool_choice="required", temperature=0, max_tokens=40, num_retries=0,
                  timeout=300)
    for prompt in FORCED_PROMPTS:
        reply = litellm.completion(messages=[{"role": "user", "content": prompt}], **common)
        choice = reply.choices[0]
        calls = choice.message.tool_calls
        assert calls and choice.finish_reason in ("tool_calls", "length"), (prompt, reply)
        assert all(c.function.name == "get_weather" and c.id for c in calls), calls
        for c in calls if choice.finish_reason == "tool_calls" else calls[:1]:
            assert violation(json.loads(c.function.arguments), OPEN_CITY) is None, (prompt, c)
            assert set(json.loads(c.function.arguments)) == {"city"}, (prompt, c)

    chunks = list(litellm.completion(messages=[{"role": "user", "content": "Weather in Oslo?"}], stream=True,
                                     stream_options={"include_usage": True}, parallel_tool_calls=False, **common))
    assert not any(c.choices and c.choices[0].delta.content for c in chunks), chunks
    built = litellm.stream_chunk_builder(chunks)
    [call] = built.choices[0].message.tool_calls
    assert built.choices[0].finish_reason == "tool_calls", built
    assert call.function.name == "get_weather" and violation(json.loads(call.function.arguments), OPEN_CITY) is None
    assert set(json.loads(call.function.arguments)) == {"city"}, call
    assert built.usage.completion_tokens and built.usage.prompt_tokens > 50, built.usage  # the server's counts
