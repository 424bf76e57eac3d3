"""Tool-call formats per model family (``--tool-call-parser``): each reads single and parallel
calls, text before a call, malformed and cut-off output; ``auto`` picks the format from the chat
template; the chat adapter renders earlier calls, reads the output and streams calls in the
chosen format."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel

from shared.grammar import compile_grammar
from shared.openai_api.adapters import ChatAdapter, Choice, Delta, ResponseHead, ToolCallStream, parse_body
from shared.openai_api.fields import CHAT_FIELDS
from shared.openai_api.models import ChatCompletionRequest
from shared.openai_api.responses_api import ResponsesAdapter
from shared.openai_api.tool_formats import FORMATS, HERMES, detect_format, tool_format
from shared.openai_api.tools import system_prompt
from shared.protocol.generate import TokenLogprob
from shared.tokenizer import Tokenizer
from word_tokens import word_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
BASE = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, TIME]}

# each format's output: one call, two calls, text then a call
OUTPUTS = {
    "hermes": ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
               'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {}}]',
                'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                    '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
                    'Let me look.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
}
OSLO, NOW = ("get_weather", {"city": "Oslo"}), ("get_time", {})


def body(fmt: str = "hermes", **fields) -> ChatCompletionRequest:
    parsed = parse_body(json.dumps({**BASE, **fields}).encode(), ChatCompletionRequest, CHAT_FIELDS)
    return parsed.with_tool_format(FORMATS[fmt])


def names_and_args(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls or []]


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_each_format_reads_single_parallel_and_after_text(fmt):
    one, two, after_text = OUTPUTS[fmt]
    parser = FORMATS[fmt]
    assert parser.parse(one) == [OSLO]
    assert parser.parse(two) == [OSLO, NOW]
    assert parser.parse(after_text) == [OSLO]
    assert parser.parse("It is sunny in Oslo.") is None
    tool_use = body(fmt).tool_use()
    assert names_and_args(tool_use.calls(two, "stop")) == [OSLO, NOW]
    assert names_and_args(body(fmt, parallel_tool_calls=False).tool_use().calls(two, "stop")) == [OSLO]
    assert tool_use.calls("It is sunny.", "stop") is None


@pytest.mark.parametrize("fmt,broken", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }]'),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{not json}"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": }'),
    ("llama3_json", '{"name": "get_weather", "parameters": {}} and then some prose'),
    ("llama3_json", 'The JSON {"name": "get_weather", "parameters": {}} is an example.'),  # prose first
])
def test_malformed_output_is_text(fmt, broken):
    assert FORMATS[fmt].parse(broken) is None
    assert body(fmt).tool_use().calls(broken, "stop") is None


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_output_cut_off_keeps_the_calls_written_whole(fmt):
    one, two, _ = OUTPUTS[fmt]
    tool_use = body(fmt).tool_use()
    # cut inside the second call: the first is kept, finish length; cut inside the first: text
    cut = two[:-12]
    assert names_and_args(tool_use.calls(cut, "length")) == [OSLO], cut
    for at in (5, len(one) // 2, len(one) - 3):
        assert tool_use.calls(one[:at], "length") is None, one[:at]
    api = ChatAdapter(body(fmt), tokenizer=None)
    choice = api.choice(0, Choice(one[:len(one) // 2], "length", []))
    assert choice["message"] == {"role": "assistant", "content": one[:len(one) // 2]}
    assert choice["finish_reason"] == "length"


def test_the_newer_mistral_form_and_a_bare_list():
    mistral = FORMATS["mistral"]
    assert mistral.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}') == [OSLO]
    assert mistral.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}') == [OSLO, NOW]
    assert mistral.whole_calls('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[AR') == [OSLO]
    # [TOOL_CALLS] is a special token a decoder may drop: the list alone still reads as calls
    assert mistral.parse('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]') == [OSLO]
    assert mistral.parse("[link](http://x) is a link") is None


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_a_stream_holds_back_a_call_and_streams_text(fmt):
    one, two, after_text = OUTPUTS[fmt]
    stream = ToolCallStream(body(fmt).tool_use())
    pieces = [two[i:i + 7] for i in range(0, len(two), 7)]
    assert all(stream.push(Delta(p)) == [] for p in pieces[:-1])
    [ended] = stream.push(Delta(pieces[-1], finish_reason="stop"))
    assert names_and_args(ended.calls) == [OSLO, NOW] and ended.finish_reason == "stop"
    text = ToolCallStream(body(fmt).tool_use())
    assert text.push(Delta("Let me")) == [Delta("Let me", [], None)]
    assert text.push(Delta(" think.", finish_reason="stop")) == [Delta(" think.", [], "stop")]


def streamed(api, text: str, size: int, finish: str = "stop") -> list[dict]:
    """The chunks of ``text`` streamed ``size`` characters a delta, each delta with one logprob."""
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    chunks = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        chunks += api.stream_chunks(HEAD, 0, Delta(piece, [TokenLogprob(token_id=i, logprob=-i)],
                                                   finish if last else None), 0)
    return chunks


HEAD = ResponseHead("chatcmpl-1", 1, "m")
# token i is "t<i>": the logprobs' tokens of ``streamed``
NUMBERED = Tokenizer(BackendTokenizer(WordLevel({f"t{i}": i for i in range(300)}, unk_token="t0")),
                     bos_token=None, eos_token=None, chat_template=None)


@pytest.mark.parametrize("size", [1, 3, 7, 25, 30, 1000])
@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_text_before_a_call_streams_as_content_then_the_call(fmt, size):
    """As vLLM and OpenAI: content until the call marker, the call held from there and sent as
    tool_calls at the end; the content is the non-streamed response's, the logprobs split there."""
    after_text = OUTPUTS[fmt][2]
    whole = ChatAdapter(body(fmt), None).choice(0, Choice(after_text, "stop", []))
    assert whole["message"]["content"] == "Let me look." and whole["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]
    chunks = streamed(ChatAdapter(body(fmt, logprobs=True), NUMBERED), after_text, size)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = [d["content"] for d in deltas if "content" in d]
    assert "".join(content) == "Let me look."
    calls = [i for i, d in enumerate(deltas) if "tool_calls" in d]
    assert calls == [len(deltas) - 2] and all("content" not in d for d in deltas[calls[0]:])
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["get_weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # a delta's logprob goes with the content when all of its text is content, else with the call
    logprobs = [[e["token"] for e in (c["choices"][0]["logprobs"] or {"content": []})["content"]] for c in chunks]
    num_content = sum(1 for i in range(0, len(after_text), size) if i + size <= len("Let me look."))
    assert sum(len(lp) for lp, d in zip(logprobs, deltas) if "content" in d) == num_content
    assert sum(len(lp) for lp in logprobs) == len(range(0, len(after_text), size))


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_a_call_cut_off_after_text_keeps_the_text_as_content(fmt):
    after_text = OUTPUTS[fmt][2]
    cut = after_text + "\n" + OUTPUTS[fmt][0][:20]
    choice = ChatAdapter(body(fmt), None).choice(0, Choice(cut, "length", []))
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Let me look."
    chunks = streamed(ChatAdapter(body(fmt), None), cut, 5, "length")
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Let me look."
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_text_that_makes_no_call_streams_whole(fmt):
    text = "Maybe <b>bold</b> or [x] {y} < z"
    for size in (1, 4, 100):
        chunks = streamed(ChatAdapter(body(fmt), None), text, size)
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert ChatAdapter(body(fmt), None).choice(0, Choice(text, "stop", []))["message"]["content"] == text


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_the_responses_api_has_a_message_then_the_calls(fmt):
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    from shared.openai_api.responses import usage
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    after_text = OUTPUTS[fmt][2]

    def api(**fields) -> ResponsesAdapter:
        adapter = ResponsesAdapter.from_json(json.dumps({"model": "m", "input": "x", "tools": tools,
                                                         **fields}).encode(), None)
        adapter.decide_tool_format(fmt)
        return adapter

    whole = api()
    parsed = Response.model_validate(whole.response(HEAD, [whole.choice(0, Choice(after_text, "stop", []))],
                                                    usage(1, 2, 0)))
    assert [o.type for o in parsed.output] == ["message", "function_call"]
    assert parsed.output_text == "Let me look." and parsed.output[1].name == "get_weather"
    stream = api(stream=True)
    events = stream.opening_chunks(HEAD, 0) + streamed(stream, after_text, 4)
    events += stream.closing_chunks(HEAD, usage(1, 2, 0))
    typed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.sequence_number for e in typed] == list(range(len(events)))
    done = [e.item for e in typed if e.type == "response.output_item.done"]
    assert [(i.type, getattr(i, "name", None)) for i in done] == [("message", None), ("function_call", "get_weather")]
    assert "".join(e.delta for e in typed if e.type == "response.output_text.delta") == "Let me look."
    final = typed[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"] and final.output_text == "Let me look."
    assert [e.output_index for e in typed if e.type == "response.output_item.added"] == [0, 1]


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_the_chat_adapter_streams_calls_as_tool_call_deltas(fmt):
    api = ChatAdapter(body(fmt), None)
    head = ResponseHead("chatcmpl-1", 1, "m")
    two = OUTPUTS[fmt][1]
    assert api.stream_chunks(head, 0, Delta(two[:10]), 0) == []
    chunks = api.stream_chunks(head, 0, Delta(two[10:], [], "stop"), 10)
    deltas = chunks[0]["choices"][0]["delta"]["tool_calls"]
    assert [(d["index"], d["function"]["name"]) for d in deltas] == [(0, "get_weather"), (1, "get_time")]
    assert chunks[1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_strict_auto_grammar_compiles_for_each_format(fmt):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    for parallel in (True, False):
        spec, param = body(fmt, tools=[strict, TIME], parallel_tool_calls=parallel).grammar()
        assert param == "tools" and spec.kind == "lark"
        assert FORMATS[fmt].marker in spec.value.replace("\\", "")
        compile_grammar(spec)


@pytest.mark.parametrize("template,fmt", [
    ("{% for t in tools %}<tool_call>{% endfor %}", "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}", "llama3_json"),
    ("{% if tools %}<|start_header_id|>user<|end_header_id|>{{ tools }}{% endif %}", "llama3_json"),
    ("<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}<|end|>", "harmony"),  # gpt-oss
    ("<|start_header_id|>user<|end_header_id|>{{ m }}", "hermes"),  # llama 3 without tools
    ("{{ messages }}", "hermes"),
    (None, "hermes"),
])
def test_auto_picks_the_format_from_the_template(template, fmt):
    assert detect_format(template).name == fmt
    assert tool_format("auto", template).name == fmt
    assert tool_format("mistral", template).name == "mistral"  # named: as named


WORDS = ["<unk>", "user", "assistant", "tool", ":"]


# a template without tool support that marks itself a Mistral model
MISTRAL_TEMPLATE = "{# [TOOL_CALLS] #}{% for m in messages %}{{ m.role }} : {{ m.content }}\n{% endfor %}"
HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
               {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "12C"}]


def rendered(api) -> str:
    return api.tokenizer.apply_chat_template(api._messages(), add_generation_prompt=True)


def test_the_chosen_format_renders_history_and_the_system_prompt():
    raw = json.dumps({**BASE, "messages": HISTORY}).encode()
    api = ChatAdapter.from_json(raw, word_tokenizer(WORDS, MISTRAL_TEMPLATE))
    assert api.body.tool_use().format is HERMES  # before the gateway decides
    api.decide_tool_format("auto")
    assert api.body.tool_use().format.name == "mistral"
    assert ('assistant : [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "get_time", "arguments": {}}]') in rendered(api)
    calls = api.choice(0, Choice(OUTPUTS["mistral"][0], "stop", []))["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    api.decide_tool_format("llama3_json")  # the flag overrides the template
    assert ('{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
            in rendered(api))
    api.decide_tool_format("hermes")
    assert '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' in rendered(api)


def test_a_template_without_tools_gets_the_format_in_the_system_prompt():
    api = ChatAdapter.from_json(json.dumps(BASE).encode(), word_tokenizer(WORDS, MISTRAL_TEMPLATE))
    api.decide_tool_format("auto")
    prompt = api.tokenizer.decode(api.prompt_ids(), skip_special_tokens=False)
    assert prompt.startswith("<unk>")  # the system message (words unknown to this vocabulary) comes first
    assert "[TOOL_CALLS][{" in system_prompt(api.body.tool_use().tools, api.body.tool_use().format)
    assert "<tool_call>" in system_prompt(api.body.tool_use().tools)


def test_the_responses_adapter_uses_the_chosen_format():
    raw = json.dumps({"model": "m", "tools": [{"type": "function", "name": "get_weather", "parameters": {}}],
                      "input": [{"type": "message", "role": "user", "content": "Weather?"},
                                {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                 "arguments": '{"city": "Oslo"}'},
                                {"type": "function_call_output", "call_id": "c1", "output": "12C"}]}).encode()
    api = ResponsesAdapter.from_json(raw, word_tokenizer(WORDS, MISTRAL_TEMPLATE))
    api.decide_tool_format("auto")
    messages = api.body.messages()
    assert messages[1] == {"role": "assistant",
                           "content": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'}
    head = ResponseHead("resp-1", 1, "m")
    events = api.stream_chunks(head, 0, Delta(OUTPUTS["mistral"][0], [], "stop"), 0)
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], json.loads(e["arguments"])) for e in done] == [OSLO]


# --- on SmolLM2's real tokenizer (the GGUF the other unit tests share) --------------------------

@pytest.fixture(scope="module")
def smol(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.mark.parametrize("fmt,call,text_with_call", [
    ("mistral", '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Oslo"}}]',
     'See [TOOL_CALLS] here'),
    ("llama3_json", '{"name":"get_weather","arguments":{"city":"Oslo"}}', '{"city": "Oslo"}'),
])
def test_strict_auto_grammar_allows_text_or_declared_calls_only(smol, fmt, call, text_with_call):
    from shared.grammar import TokenizerGrammars
    grammars = TokenizerGrammars(smol.to_json(), smol.vocab_size, smol.stop_token_ids)
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    spec, _ = body(fmt, tools=[strict]).grammar()

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(spec).ll
        return all(matcher.consume_token(t) for t in smol.encode(text)) and matcher.is_accepting()

    assert accepts("It is sunny in Oslo.") and accepts(call)
    assert not accepts(call.replace("get_weather", "rm_rf")) and not accepts(text_with_call)
    assert names_and_args(body(fmt, tools=[strict]).tool_use().calls(call, "stop")) == [OSLO]


def test_smollm2_with_the_hermes_parser_named(smol):
    """SmolLM2's template has no tool markers: auto and ``--tool-call-parser hermes`` agree, and
    the tools come in a system message asking for <tool_call> blocks."""
    assert tool_format("auto", smol.chat_template) is HERMES
    api = ChatAdapter.from_json(json.dumps({**BASE, "messages": HISTORY}).encode(), smol)
    api.decide_tool_format("hermes")
    prompt = smol.decode(api.prompt_ids(), skip_special_tokens=False)
    assert "To call one, reply with <tool_call>" in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in prompt
    reply = api.choice(0, Choice(OUTPUTS["hermes"][1], "stop", []))
    assert reply["finish_reason"] == "tool_calls" and len(reply["message"]["tool_calls"]) == 2


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_streamed_and_whole_replies_agree_however_the_output_is_cut_into_deltas(fmt):
    one, two, after_text = OUTPUTS[fmt]
    rng = random.Random(7)
    outputs = [one, two, after_text, after_text + " and more text", "Plain text, [a] <b> {c}.",
               "A < B\n", "x" + FORMATS[fmt].marker, after_text[:-5], "Text.\n\n" + two]
    for text, finish in [(o, f) for o in outputs for f in ("stop", "length")]:
        whole = ChatAdapter(body(fmt), None).choice(0, Choice(text, finish, []))
        api, chunks, at = ChatAdapter(body(fmt), None), [], 0
        while at < len(text):
            size = rng.randint(1, 9)
            piece, at = text[at:at + size], at + size
            chunks += api.stream_chunks(HEAD, 0, Delta(piece, [], finish if at >= len(text) else None), 0)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        where = (text, finish)
        assert "".join(d.get("content", "") for d in deltas) == (whole["message"]["content"] or ""), where
        assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == \
            [c["function"]["name"] for c in whole["message"].get("tool_calls") or []], where
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"], where
