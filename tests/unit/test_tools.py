"""Tool calls without a model: the forced-call grammar compiles and names its functions, calls
are read back from text, a streamed choice holds back what may become a call, and tool_choice is
checked against the tools."""

from __future__ import annotations

import json

import pytest

from shared.grammar import compile_grammar
from shared.openai_api.adapters import ChatAdapter, Delta, ToolCallStream, parse_body
from shared.openai_api.errors import ApiError
from shared.openai_api.fields import CHAT_FIELDS
from shared.openai_api.models import ChatCompletionRequest
from shared.openai_api.tools import Tool, forced_grammar, parse_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
BASE = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, TIME]}


def body(**fields) -> ChatCompletionRequest:
    return parse_body(json.dumps({**BASE, **fields}).encode(), ChatCompletionRequest, CHAT_FIELDS)


def test_modes_and_the_forced_grammar():
    assert body().tool_mode() == "auto" and body(tool_choice="none").tool_mode() == "none"
    named = body(tool_choice={"type": "function", "function": {"name": "get_time"}})  # one call, parallel or not
    spec, param = named.grammar()
    schema = json.loads(spec.value)
    assert param == "tools" and schema["maxItems"] == 1
    assert schema["items"]["properties"]["name"] == {"const": "get_time"}
    compile_grammar(spec)
    spec, _ = body(tool_choice="required").grammar()
    assert "maxItems" not in json.loads(spec.value)
    assert [c["properties"]["name"]["const"] for c in json.loads(spec.value)["items"]["anyOf"]] == \
        ["get_weather", "get_time"]
    compile_grammar(spec)
    assert body().grammar() is None


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
])
def test_bad_tool_requests_are_400_naming_the_parameter(fields, param):
    with pytest.raises(ApiError) as info:
        body(**fields)
    assert info.value.param == param, info.value.body()


def test_calls_are_read_back():
    forced = parse_calls('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', forced=True)
    assert forced[0].function.name == "get_weather" and json.loads(forced[0].function.arguments) == {"city": "Oslo"}
    auto = parse_calls('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
                       '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>', forced=False)
    assert [c.function.name for c in auto] == ["get_time", "get_weather"] and auto[0].id != auto[1].id
    assert parse_calls("It is sunny.", forced=False) is None
    assert parse_calls("<tool_call>{broken</tool_call>", forced=False) is None


def test_a_streamed_choice_holds_back_what_may_become_a_call():
    stream = ToolCallStream(forced=False)
    assert stream.push(Delta("<tool")) is None and stream.push(Delta("_call>{\"name\": \"get_time\",")) is None
    calls = stream.push(Delta(' "arguments": {}}</tool_call>', finish_reason="stop"))
    assert [c.function.name for c in calls] == ["get_time"]
    text = ToolCallStream(forced=False)
    assert text.push(Delta("<t")) is None
    assert text.push(Delta("able> is")) == Delta("<table> is", [], None)  # not a call after all
    assert text.push(Delta(" here", finish_reason="stop")) == Delta(" here", [], "stop")


def test_an_assistant_call_and_a_tool_result_render_in_the_history():
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12C"}]
    parsed = body(messages=history)
    assert parsed.messages[1].text() == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert parsed.messages[2].text() == "12C"
