"""``/v1/responses`` without a server: the request's parameters, its prompt, and the response
and streamed events as the official SDK's types read them."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, response_create_params
from pydantic import TypeAdapter

from shared.openai_api.adapters import Choice, Delta, ResponseHead
from shared.openai_api.errors import ApiError
from shared.openai_api.fields import RESPONSES_FIELDS
from shared.openai_api.responses import usage
from shared.openai_api.responses_api import ResponsesAdapter
from shared.tokenizer import Tokenizer
from word_tokens import word_tokenizer

WORDS = ["<unk>", "system", "user", "assistant", ":", "be", "brief", "hello", "world", "{", "}"]
TEMPLATE = "{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}assistant :"
HEAD = ResponseHead("resp-abc", 7, "m")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return word_tokenizer(WORDS, TEMPLATE)


def adapter(tok, **fields) -> ResponsesAdapter:
    return ResponsesAdapter.from_json(json.dumps({"model": "m", "input": "hello world", **fields}).encode(), tok)


def test_every_sdk_parameter_has_a_status():
    assert set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"} <= set(RESPONSES_FIELDS)


def test_prompt_and_refusals(tok):
    api = adapter(tok, instructions="be brief")
    assert api.prompt_ids() == tok.encode("system : be brief user : hello world assistant :")
    listed = adapter(tok, input=[{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}])
    assert listed.prompt_ids() == tok.encode("user : hello assistant :")
    for fields, param in (({"background": True, "store": False}, "background"),
                          ({"background": True, "stream": True}, "stream"), ({"n": 2}, "n"), ({"text": {"format": {"type": "xml"}}}, "text.format.type")):
        with pytest.raises(ApiError) as info:
            adapter(tok, **fields)
        assert info.value.param == param, info.value.body()
    spec, param = adapter(tok, text={"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}}}).body.grammar()
    assert (spec.kind, param) == ("json_schema", "text.format")


def test_response_and_events_read_by_the_sdk(tok):
    api = adapter(tok, max_output_tokens=5)
    body = api.response(HEAD, [api.choice(0, Choice("hello", "length", []))], usage(3, 5, 0))
    parsed = Response.model_validate(body)
    assert parsed.output_text == "hello" and parsed.status == "incomplete"
    assert parsed.incomplete_details.reason == "max_output_tokens" and parsed.usage.output_tokens == 5

    from openai.types.responses import ResponseStreamEvent
    events = [*api.opening_chunks(HEAD, 0)]
    events += api.stream_chunks(HEAD, 0, Delta("hel"), 0) + api.stream_chunks(HEAD, 0, Delta("lo", [], "stop"), 3)
    events += api.closing_chunks(HEAD, usage(3, 2, 0))
    typed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.sequence_number for e in typed] == list(range(len(events)))
    assert typed[0].type == "response.created" and typed[-1].type == "response.completed"
    assert "".join(e.delta for e in typed if e.type == "response.output_text.delta") == "hello"
    assert typed[-1].response.output_text == "hello" and typed[-1].response.usage.total_tokens == 5


def test_streamed_events_are_named_by_their_type_as_the_sdk_reads_them(tok):
    from openai._streaming import SSEDecoder
    api = adapter(tok, stream=True)
    events = [*api.opening_chunks(HEAD, 0), *api.stream_chunks(HEAD, 0, Delta("hello", [], "stop"), 0),
              *api.closing_chunks(HEAD, usage(3, 1, 0))]
    wire = b"".join(api.sse_event(e) for e in events)
    assert wire.startswith(b"event: response.created\ndata: {")
    read = list(SSEDecoder().iter_bytes(iter([wire])))
    assert [(s.event, s.json()) for s in read] == [(e["type"], e) for e in events]
    from shared.openai_api.adapters import ChatAdapter
    chat = ChatAdapter.from_json(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}],
                                             "stream": True}).encode(), tok)
    assert chat.sse_event({"object": "chat.completion.chunk", "type": "x"}).startswith(b"data: ")


WEATHER = {"type": "function", "name": "get_weather", "description": "weather of a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


def test_off_values_are_accepted(tok):
    # openai-agents' OpenAIResponsesModel sends include: [] on every request
    api = adapter(tok, include=[], top_logprobs=0, tools=[], tool_choice="auto", parallel_tool_calls=True,
                  reasoning={"effort": None}, max_tool_calls=3, stream_options={"include_obfuscation": True},
                  text={"format": {"type": "text"}, "verbosity": "medium"})
    assert api.body.tool_mode() == "none"
    for fields, param in (({"include": ["message.output_text.logprobs"]}, "include"), ({"top_logprobs": 2}, "top_logprobs"),
                          ({"reasoning": {"effort": "high", "summary": "auto"}}, "reasoning.summary"),
                          ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
                          ({"text": {"verbosity": "terse"}}, "text.verbosity")):
        with pytest.raises(ApiError) as info:
            adapter(tok, **fields)
        assert info.value.param == param, info.value.body()


def test_verbosity_and_reasoning_effort_are_accepted_and_echoed(tok):
    """No verbosity or reasoning control here: the values are echoed as OpenAI echoes them, and
    change nothing in generation (the same prompt and sampling)."""
    plain = adapter(tok)
    api = adapter(tok, text={"verbosity": "low"}, reasoning={"effort": "high"})
    assert api.prompt_ids() == plain.prompt_ids() and api.body.grammar() == plain.body.grammar()
    parsed = Response.model_validate(api.response(HEAD, [api.choice(0, Choice("hello", "stop", []))], usage(3, 1, 0)))
    assert parsed.text.verbosity == "low" and parsed.reasoning.effort == "high"
    assert parsed.text.format.type == "text"
    shell = Response.model_validate(plain.shell(HEAD, "queued"))
    assert shell.text.verbosity == "medium" and shell.reasoning.effort is None


def test_function_tools_and_their_round_trip_in_the_prompt(tok):
    history = [{"role": "user", "content": "hello"},
               {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "world"}', "status": "completed"},
               {"type": "function_call_output", "call_id": "call_1", "output": "brief"}]
    api = adapter(tok, input=history, tools=[WEATHER])
    assert api.body.tool_mode() == "auto"
    spec, param = api.body.grammar()  # strict: enforced under auto
    assert (spec.kind, param) == ("lark", "tools")
    messages = api.body.messages()
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "world"}}</tool_call>'
    assert messages[2]["content"] == "brief"
    forced = adapter(tok, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert forced.body.tool_mode() == "forced" and json.loads(forced.body.grammar()[0].value)["maxItems"] == 1
    for fields, param in (({"tool_choice": "required"}, "tool_choice"),
                          ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
                          ({"tools": [{"type": "web_search"}]}, "tools.0.type")):
        with pytest.raises(ApiError) as info:
            adapter(tok, **fields)
        assert info.value.param == param, info.value.body()


def test_function_calls_in_the_response_and_events_read_by_the_sdk(tok):
    from openai.types.responses import ResponseStreamEvent
    call = '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>'
    api = adapter(tok, tools=[WEATHER])
    parsed = Response.model_validate(api.response(HEAD, [api.choice(0, Choice(call, "stop", []))], usage(3, 5, 0)))
    assert parsed.status == "completed" and parsed.output_text == ""
    item = parsed.output[0]
    assert (item.type, item.name, json.loads(item.arguments)) == ("function_call", "get_weather", {"city": "Oslo"})
    assert item.call_id.startswith("call_") and parsed.tools[0].name == "get_weather"

    api = adapter(tok, tools=[WEATHER], stream=True)
    events = [*api.opening_chunks(HEAD, 0)]
    for i, piece in enumerate((call[:9], call[9:30], call[30:])):
        events += api.stream_chunks(HEAD, 0, Delta(piece, [], "stop" if i == 2 else None), 0)
    events += api.closing_chunks(HEAD, usage(3, 5, 0))
    typed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.type for e in typed] == ["response.created", "response.in_progress", "response.output_item.added",
                                       "response.function_call_arguments.delta",
                                       "response.function_call_arguments.done", "response.output_item.done",
                                       "response.completed"]
    assert [e.sequence_number for e in typed] == list(range(len(events)))
    assert json.loads(typed[4].arguments) == {"city": "Oslo"} and typed[5].item.name == "get_weather"
    assert typed[-1].response.output[0].type == "function_call"

    # with tools but answered in text: the message opens with the text
    api = adapter(tok, tools=[WEATHER], stream=True)
    events = [*api.opening_chunks(HEAD, 0)] + api.stream_chunks(HEAD, 0, Delta("Sunny", [], "stop"), 0)
    events += api.closing_chunks(HEAD, usage(3, 1, 0))
    typed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.type for e in typed][2:5] == ["response.output_item.added", "response.content_part.added",
                                            "response.output_text.delta"]
    assert typed[-1].response.output_text == "Sunny"


def test_a_forced_call_cut_off_keeps_the_calls_written_whole_and_is_incomplete(tok):
    api = adapter(tok, tools=[WEATHER], tool_choice="required", max_output_tokens=8)
    text = '[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"get_weather","arguments":{"ci'
    body = api.response(HEAD, [api.choice(0, Choice(text, "length", []))], usage(3, 8, 0))
    parsed = Response.model_validate(body)
    assert parsed.status == "incomplete" and parsed.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.name, o.arguments) for o in parsed.output] == \
        [("function_call", "get_weather", '{"city": "Oslo"}')]
    # none written whole: the output is the text, incomplete (arguments that are not JSON never come back)
    body = api.response(HEAD, [api.choice(0, Choice(text[:40], "length", []))], usage(3, 8, 0))
    parsed = Response.model_validate(body)
    assert parsed.status == "incomplete" and [o.type for o in parsed.output] == ["message"]


def test_a_continued_request_puts_the_stored_items_first_and_lists_its_own(tok):
    from shared.openai_api.stored.items import input_items, items_page

    api = adapter(tok, previous_response_id="resp_1", store=True, metadata={"k": "v"})
    own = input_items(api.body)
    assert [(i["type"], i["role"], i["content"]) for i in own] == [
        ("message", "user", [{"type": "input_text", "text": "hello world"}])]
    assert own[0]["id"].startswith("msg_")
    earlier = [{"id": "msg_a", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "be"}]},
               {"id": "msg_b", "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "brief", "annotations": [], "logprobs": []}]}]
    continued = ResponsesAdapter(api.body.continued(earlier), tok)
    assert continued.prompt_ids() == tok.encode("user : be assistant : brief user : hello world assistant :")
    body = continued.response(HEAD, [continued.choice(0, Choice("world", "stop", []))], usage(3, 1, 0))
    assert Response.model_validate(body).previous_response_id == "resp_1"
    assert body["store"] is True and body["metadata"] == {"k": "v"} and continued.completed is body
    listed = items_page(earlier, limit=1, order="desc", after=None)
    assert (listed["first_id"], listed["has_more"]) == ("msg_b", True)
    assert items_page(earlier, limit=5, order="asc", after="msg_a")["data"] == earlier[1:]
    with pytest.raises(ApiError):
        items_page(earlier, limit=5, order="sideways", after=None)
