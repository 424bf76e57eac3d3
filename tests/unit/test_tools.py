"""Tool calls without a model: the forced-call grammar compiles and names its functions, calls
are read back from text, a streamed choice holds back what may become a call, and tool_choice is
checked against the tools."""

from __future__ import annotations

import json

import pytest

from shared.grammar import compile_grammar
from shared.openai_api.adapters import ChatAdapter, Choice, Delta, ResponseHead, ToolCallStream, parse_body
from shared.openai_api.errors import ApiError
from shared.openai_api.fields import CHAT_FIELDS
from shared.openai_api.models import ChatCompletionRequest
from shared.openai_api.tools import MAX_FORCED_CALLS, closed_schema, parse_calls

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
    assert json.loads(spec.value)["maxItems"] == MAX_FORCED_CALLS  # a loop of repeats ends there
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
    stream = ToolCallStream(body().tool_use())
    assert stream.push(Delta("<tool")) == [] and stream.push(Delta("_call>{\"name\": \"get_time\",")) == []
    [ended] = stream.push(Delta(' "arguments": {}}</tool_call>', finish_reason="stop"))
    assert [c.function.name for c in ended.calls] == ["get_time"] and ended.finish_reason == "stop"
    text = ToolCallStream(body().tool_use())
    assert text.push(Delta("<t")) == []
    assert text.push(Delta("able> is")) == [Delta("<table> is", [], None)]  # not a call after all
    assert text.push(Delta(" here <", finish_reason="stop")) == [Delta(" here <", [], "stop")]


def test_an_assistant_call_and_a_tool_result_render_in_the_history():
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12C"}]
    parsed = body(messages=history)
    assert parsed.messages[1].text() == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert parsed.messages[2].text() == "12C"


def test_tool_argument_schemas_are_closed_unless_they_say_otherwise():
    spec, _ = body(tool_choice="required").grammar()
    weather = json.loads(spec.value)["items"]["anyOf"][0]["properties"]["arguments"]
    assert weather["additionalProperties"] is False
    open_args = {"type": "object", "additionalProperties": True, "properties": {
        "where": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}}}}
    closed = closed_schema(open_args)
    assert closed["additionalProperties"] is True  # said explicitly: kept
    assert closed["properties"]["where"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed_schema({"type": "string"}) == {"type": "string"}
    assert "additionalProperties" not in closed_schema({"allOf": [{"type": "object"}]})


def test_output_cut_off_keeps_only_the_calls_written_whole():
    api = ChatAdapter(body(tool_choice="required"), tokenizer=None)
    choice = api.choice(0, Choice('[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":{"city":"Os',
                                  "length", []))
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "get_time", "arguments": "{}"}]
    assert parse_forced('[{"name":"get_time","arguments":{}}') == [("get_time", "{}")]  # before "," or "]"
    # no call written whole: the output is text, finish_reason length (as any output cut off)
    for cut in ('[{"name":"get_weather","arguments":{"city":"Os', '[{"name":"get_t', "[", ""):
        assert body(tool_choice="required").tool_use().calls(cut, "length") is None, cut
    choice = api.choice(0, Choice('[{"name":"get_weather","arguments":{"ci', "length", []))
    assert choice["message"] == {"role": "assistant", "content": '[{"name":"get_weather","arguments":{"ci'}
    assert choice["finish_reason"] == "length"
    # under auto: a <tool_call> block counts once its closing tag is written
    auto = body().tool_use()
    whole = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert [c.function.name for c in auto.calls(whole + '\n<tool_call>{"name": "get_weather", "argu', "length")] == \
        ["get_time"]
    assert auto.calls(whole[:-3], "length") is None and auto.calls('<tool_call>{"name": "get_', "length") is None
    # streamed: nothing as content, then the whole calls and finish_reason length
    stream_api = ChatAdapter(body(tool_choice="required"), None)
    head = ResponseHead("chatcmpl-1", 1, "m")
    assert stream_api.stream_chunks(head, 0, Delta('[{"name":"get_time","arguments":{}},'), 0) == []
    chunks = stream_api.stream_chunks(head, 0, Delta('{"name":"get_weather","arguments":{"city":"R', [], "length"), 0)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert all("content" not in c["choices"][0]["delta"] for c in chunks)


def test_a_repeat_of_an_earlier_call_is_dropped():
    """SmolLM2 under tool_choice required, greedy, repeats its first call until the token limit."""
    oslo = '{"name":"get_weather","arguments":{"city":"Oslo"}}'
    loop = "[" + ",".join([oslo] * 7 + ['{"name":"get_weather","arguments":{"city":"Rome"}}', oslo]) + "]"
    assert parse_forced(loop, "stop") == [("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')]
    cut = "[" + ",".join([oslo] * 12) + ',{"name":"get_weather","arguments":'
    assert parse_forced(cut) == [("get_weather", '{"city": "Oslo"}')]
    # the same arguments in another key order are the same call; another function is another call
    auto = body(tools=[WEATHER, TIME, {"type": "function", "function": {"name": "add", "parameters": {}}}]).tool_use()
    two = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
           '<tool_call>{"name": "add", "arguments": {"b": 2, "a": 1}}</tool_call>'
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert [c.function.name for c in auto.calls(two, "stop")] == ["add", "get_time"]


def parse_forced(text: str, finish_reason: str = "length") -> list[tuple[str, str]]:
    calls = body(tool_choice="required").tool_use().calls(text, finish_reason)
    return [(c.function.name, c.function.arguments) for c in calls]


def test_parallel_tool_calls_false_means_one_call():
    two = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    assert len(body().tool_use().calls(two, "stop")) == 2
    assert [c.function.name for c in body(parallel_tool_calls=False).tool_use().calls(two, "stop")] == ["get_time"]
    forced = '[{"name":"get_time","arguments":{}},{"name":"get_time","arguments":{}}]'
    assert len(body(tool_choice="required", parallel_tool_calls=False).tool_use().calls(forced, "stop")) == 1
    assert json.loads(body(tool_choice="required", parallel_tool_calls=False).grammar()[0].value)["maxItems"] == 1


def test_a_strict_function_is_enforced_under_auto():
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    assert body().grammar() is None  # no strict function: the model is free, its calls are checked
    spec, param = body(tools=[strict, TIME]).grammar()
    assert (spec.kind, param) == ("lark", "tools") and "<tool_call>" in spec.value
    compile_grammar(spec)
    assert "calls: call\n" in body(tools=[strict, TIME], parallel_tool_calls=False).grammar()[0].value
    # a call of a function never declared is not a call
    undeclared = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert body().tool_use().calls(undeclared, "stop") is None
    assert body(tools=[strict]).tool_use().calls(undeclared, "stop") is None
