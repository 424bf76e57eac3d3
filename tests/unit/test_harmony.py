"""gpt-oss's harmony output (``shared.openai_api.harmony``): the analysis channel as reasoning, the
final channel as content, messages to ``functions.NAME`` as tool calls; whole or streamed in
pieces cut anywhere; its markers (special tokens, kept for the parsers) never shown. A tiny
byte-level tokenizer with harmony's special tokens stands in for gpt-oss's."""

from __future__ import annotations

import json
import random

import pytest
from test_tool_markers import byte_level_tokenizer

from shared.openai_api.adapters import ChatAdapter, Choice, Delta, ResponseHead
from shared.openai_api.harmony import MARKERS, Header, parse_header, read_messages
from shared.openai_api.reasoning import ReasoningSplitter, Start, reasoning_start, split_reasoning
from shared.openai_api.responses import usage
from shared.openai_api.responses_api import ResponsesAdapter
from shared.openai_api.tool_formats import FORMATS, detect_format, tool_format
from shared.protocol import GenerateRequest
from shared.tokenizer import IncrementalDetokenizer, Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HEAD = ResponseHead("chatcmpl-1", 1, "m")

# a harmony template as gpt-oss's renders it (the parts these tests reach): the calls from
# ``tool_calls``, a tool result addressed back from the function that was called
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}{% set c = m.tool_calls[0].function %}"
    "<|start|>assistant to=functions.{{ c.name }}<|channel|>commentary json<|message|>{{ c.arguments|tojson }}<|call|>"
    "{% elif m.role == 'tool' %}<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
    "{{ m.content|tojson }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if tools %}{{ tools|length }} tools{% endif %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")

THINK = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
FINAL = THINK + "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"
CALL_AFTER = THINK + ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
                      '<|message|>{"city": "Paris"}<|call|>')
CALL_BEFORE = THINK + '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
PARALLEL = CALL_AFTER + '<|start|>assistant<|channel|>commentary to=functions.get_time json<|message|>{}<|call|>'
PARIS = ("get_weather", {"city": "Paris"})


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """Byte-level (``test_tool_markers.byte_level_tokenizer``), harmony's markers special tokens."""
    return byte_level_tokenizer([*MARKERS, "<|endoftext|>"], "<|return|>", TEMPLATE)


def chat(tok: Tokenizer, tools: bool = True, **fields) -> ChatAdapter:
    """A chat request decided as the gateway decides it (both parsers ``auto``)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    api = ChatAdapter.from_json(json.dumps({**body, **({"tools": [WEATHER, TIME]} if tools else {})}).encode(), tok)
    api.decide_tool_format("auto")
    api.decide_reasoning("auto", GenerateRequest(request_id="r", model="m", prompt_token_ids=api.prompt_ids()))
    return api


def generated(tok: Tokenizer, text: str, kept: frozenset[int]) -> str:
    """``text`` as the model generates it, detokenized a token at a time as the gateway does."""
    detok = IncrementalDetokenizer(tok, tok.encode("<|start|>assistant"), kept_special_ids=kept)
    return "".join(detok.push([i]) for i in tok.encode(text)) + detok.flush()


def whole(api: ChatAdapter, text: str, finish: str = "stop") -> dict:
    reasoning, content = split_reasoning(text, api.reasoning)
    return api.choice(0, Choice(content, finish, [], reasoning))


def streamed(api: ChatAdapter, text: str, finish: str, cuts: list[int]) -> list[dict]:
    """``text`` in pieces cut at ``cuts``, through the reasoning splitter and the chat adapter as
    the gateway's generation sends them: the deltas."""
    splitter, bounds, chunks = ReasoningSplitter(api.reasoning), [0, *cuts, len(text)], []
    for a, b in zip(bounds, bounds[1:]):
        reasoning, content = splitter.push(text[a:b])
        if b == len(text):
            more_reasoning, more_content = splitter.flush()
            reasoning, content = reasoning + more_reasoning, content + more_content
        chunks += api.stream_chunks(HEAD, 0, Delta(content, [], finish if b == len(text) else None, reasoning), 0)
    return chunks


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]


def test_the_header_as_openai_harmony_reads_it():
    assert parse_header("<|channel|>analysis") == Header("analysis", None, None)
    assert parse_header("<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json") == \
        Header("commentary", "functions.f", "json")
    assert parse_header("<|start|>assistant to=functions.f<|channel|>commentary json") == \
        Header("commentary", "functions.f", "json")
    assert parse_header("<|start|>assistant<|channel|>final") == Header("final", None, None)


def test_auto_picks_harmony_from_the_template(tok):
    assert detect_format(TEMPLATE).name == "harmony" and tool_format("auto", TEMPLATE).name == "harmony"
    assert detect_format("{{ '<|channel|>' }}").name == "harmony"
    assert detect_format("<|start_header_id|>user<|end_header_id|>{{ m }}").name == "hermes"  # Llama 3: not harmony
    assert reasoning_start("auto", uses_template=True, template=TEMPLATE, prompt_end="<|start|>assistant") \
        is Start.HARMONY
    assert reasoning_start("harmony", uses_template=True, template=None, prompt_end=None) is Start.HARMONY
    assert reasoning_start("none", uses_template=True, template=TEMPLATE, prompt_end=None) is None
    assert reasoning_start("auto", uses_template=True, template="{{ messages }}", prompt_end=None) is None
    api = chat(tok)
    assert api.reasoning is Start.HARMONY and api.body.tool_use().format is FORMATS["harmony"]
    # kept for the parsers, with tools or without; the other special tokens stay skipped
    markers = {tok.special_token_id(m) for m in MARKERS}
    assert api.kept_token_ids() == markers and chat(tok, tools=False).kept_token_ids() == markers
    assert tok.special_token_id("<|endoftext|>") not in api.kept_token_ids()


def test_analysis_and_final_are_reasoning_and_content(tok):
    for api in (chat(tok), chat(tok, tools=False)):
        text = generated(tok, FINAL, api.kept_token_ids())
        assert text == FINAL  # the markers reach the splitter
        message = whole(api, text)["message"]
        assert message == {"role": "assistant", "content": "It is sunny in Paris.",
                           "reasoning_content": "The user wants the weather."}
    # skipped, as a decoder that drops special tokens would: no channels to tell apart
    assert generated(tok, FINAL, frozenset()) == "analysisThe user wants the weather.assistantfinalIt is sunny in Paris."


@pytest.mark.parametrize("output", [CALL_AFTER, CALL_BEFORE, CALL_AFTER.removesuffix("<|call|>")])
def test_a_call_after_reasoning_with_the_recipient_before_or_after_the_channel(tok, output):
    api = chat(tok)
    choice = whole(api, generated(tok, output, api.kept_token_ids()))  # without <|call|>: the engine stopped on it
    assert calls_of(choice["message"]) == [PARIS] and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "The user wants the weather."
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_parallel_calls_and_a_preamble(tok):
    api = chat(tok)
    assert calls_of(whole(api, PARALLEL)["message"]) == [PARIS, ("get_time", {})]
    assert calls_of(whole(chat(tok, parallel_tool_calls=False), PARALLEL)["message"]) == [PARIS]
    preamble = THINK + "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>" + CALL_AFTER[len(THINK):]
    message = whole(api, preamble)["message"]
    assert message["content"] == "Let me check." and calls_of(message) == [PARIS]


@pytest.mark.parametrize("output,content", [
    (CALL_AFTER[:-len('"}<|call|>')], '{"city": "Paris'),  # cut off inside the arguments: the text, no call
    (CALL_AFTER[:-len('<|call|>')], '{"city": "Paris"}'),  # the arguments whole, the message not ended
    (CALL_AFTER[:-len('son<|message|>{"city": "Paris"}<|call|>')], None),  # cut off in the header
    (THINK[:-len("weather.<|end|>")], None),  # cut off while reasoning: no content (null)
])
def test_output_cut_off_by_the_token_limit_makes_no_call(tok, output, content):
    choice = whole(chat(tok), output, "length")
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "length"
    assert choice["message"]["content"] == content


def test_cut_off_after_a_whole_call_keeps_it(tok):
    choice = whole(chat(tok), PARALLEL[:-len("{}<|call|>")], "length")
    assert calls_of(choice["message"]) == [PARIS] and choice["finish_reason"] == "length"


@pytest.mark.parametrize("output", [
    THINK + "<|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{not json<|call|>",
    THINK + "<|start|>assistant<|channel|>commentary to=functions.unknown json<|message|>{}<|call|>",
])
def test_malformed_calls_are_text(tok, output):
    message = whole(chat(tok), output)["message"]
    assert "tool_calls" not in message and not any(m in (message["content"] or "") for m in MARKERS)


OUTPUTS = [FINAL, CALL_AFTER, CALL_BEFORE, PARALLEL, FINAL.removesuffix("<|return|>"), "no harmony at all",
           THINK + THINK + "<|start|>assistant<|channel|>final<|message|>a <|b|> c<|return|>",
           CALL_AFTER[:-12], PARALLEL[:-10], THINK[:-9]]


@pytest.mark.parametrize("tools", [True, False])
def test_streamed_deltas_cut_anywhere_give_the_whole_reply(tok, tools):
    rng = random.Random(11)
    for text in OUTPUTS:
        for finish in ("stop", "length"):
            expected = whole(chat(tok, tools=tools), text, finish)
            for _ in range(12):
                cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 30))))
                chunks = streamed(chat(tok, tools=tools, stream=True), text, finish, cuts)
                deltas = [c["choices"][0]["delta"] for c in chunks]
                where = (text, finish, cuts)
                content = "".join(d.get("content") or "" for d in deltas)
                assert content == (expected["message"]["content"] or ""), where
                assert "".join(d.get("reasoning_content", "") for d in deltas) == \
                    expected["message"].get("reasoning_content", ""), where
                assert [c for d in deltas for c in calls_of(d)] == calls_of(expected["message"]), where
                assert chunks[-1]["choices"][0]["finish_reason"] == expected["finish_reason"], where
                assert not any(m in content or m in d.get("reasoning_content", "") for m in MARKERS for d in deltas)


def test_reasoning_streams_before_the_answer_and_calls_come_last(tok):
    api = chat(tok, stream=True)
    chunks = streamed(api, CALL_AFTER, "stop", list(range(1, len(CALL_AFTER))))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"reasoning_content": "T"}  # a character at a time, as it comes
    assert [i for i, d in enumerate(deltas) if "tool_calls" in d] == [len(deltas) - 2]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_earlier_calls_and_results_render_as_the_template_writes_them(tok):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    api = chat(tok, messages=[{"role": "user", "content": "Weather?"},
                              {"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    prompt = tok.decode(api.prompt_ids(), skip_special_tokens=False)
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>') in prompt
    # a template that does not render calls gets them written in harmony into the content
    assert FORMATS["harmony"].render([PARIS]) == ('<|start|>assistant to=functions.get_weather<|channel|>commentary '
                                                  'json<|message|>{"city": "Paris"}<|call|>')
    assert read_messages(FORMATS["harmony"].render([PARIS]))[0].function == "get_weather"


def test_the_responses_api_has_a_reasoning_item_then_the_call(tok):
    api = ResponsesAdapter.from_json(json.dumps({"model": "m", "input": "x", "tools": [
        {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]}).encode(), tok)
    api.decide_tool_format("auto")
    api.decide_reasoning("auto", GenerateRequest(request_id="r", model="m", prompt_token_ids=api.prompt_ids()))
    assert api.kept_token_ids() == {tok.special_token_id(m) for m in MARKERS}
    reasoning, content = split_reasoning(CALL_AFTER, api.reasoning)
    body = api.response(HEAD, [api.choice(0, Choice(content, "stop", [], reasoning))], usage(1, 2, 0))
    assert [o["type"] for o in body["output"]] == ["reasoning", "function_call"]
    assert body["output"][0]["content"][0]["text"] == "The user wants the weather."
    assert json.loads(body["output"][1]["arguments"]) == {"city": "Paris"}


def test_a_strict_function_brings_harmonys_grammar_and_the_reasoning_is_still_split(tok):
    """The grammar itself: ``test_harmony_grammar``."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [strict]}
    api = ChatAdapter.from_json(json.dumps(body).encode(), tok)
    api.decide_tool_format("auto")
    api.decide_reasoning("auto", GenerateRequest(request_id="r", model="m", prompt_token_ids=api.prompt_ids()))
    spec, param = api.body.grammar()
    assert param == "tools" and spec.kind == "lark" and "to=functions.get_weather" in spec.value
    assert api.reasoning is Start.HARMONY
    output = CALL_AFTER.replace('{"city": "Paris"}', '{"city":"Paris"}')  # as the grammar writes it: compact
    choice = whole(api, generated(tok, output, api.kept_token_ids()))
    assert calls_of(choice["message"]) == [PARIS]
    assert choice["message"]["reasoning_content"] == "The user wants the weather."


def test_a_forced_call_is_a_harmony_call_message(tok):
    """``required``: one of the functions, called in the message gpt-oss writes (not a JSON list);
    constrained from its first token, so no reasoning before it."""
    api = chat(tok, tool_choice="required")
    spec, param = api.body.grammar()
    assert param == "tools" and spec.kind == "lark" and "to=functions.get_time" in spec.value
    assert api.reasoning is None
    output = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
    for text in (output, output + "<|call|>"):  # the engine stopped on <|call|>, or kept it
        choice = whole(api, generated(tok, text, api.kept_token_ids()))
        assert calls_of(choice["message"]) == [PARIS] and choice["message"]["content"] is None
        assert choice["finish_reason"] == "tool_calls"
    deltas = [c["choices"][0]["delta"] for c in streamed(api, output, "stop", list(range(1, len(output), 5)))]
    assert not any(d.get("content") for d in deltas)
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls") or []] == ["get_weather"]


def test_the_final_answer_streams_as_it_comes(tok):
    chunks = streamed(chat(tok, stream=True), FINAL, "stop", list(range(1, len(FINAL))))
    content = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"][0]["delta"].get("content")]
    assert len(content) > 10 and "".join(content) == "It is sunny in Paris."


def test_a_streamed_response_has_reasoning_events_then_the_call(tok):
    api = ResponsesAdapter.from_json(json.dumps({"model": "m", "input": "x", "stream": True, "tools": [
        {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]}).encode(), tok)
    api.decide_tool_format("auto")
    api.decide_reasoning("auto", GenerateRequest(request_id="r", model="m", prompt_token_ids=api.prompt_ids()))
    splitter, events = ReasoningSplitter(api.reasoning), []
    for i, piece in enumerate(CALL_BEFORE[j:j + 7] for j in range(0, len(CALL_BEFORE), 7)):
        reasoning, content = splitter.push(piece)
        last = (i + 1) * 7 >= len(CALL_BEFORE)
        if last:
            more = splitter.flush()
            reasoning, content = reasoning + more[0], content + more[1]
        events += api.stream_chunks(HEAD, 0, Delta(content, [], "stop" if last else None, reasoning), 0)
    kinds = [e["type"] for e in events]
    assert "response.output_text.delta" not in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.function_call_arguments.done")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["name"] == "get_weather" and json.loads(done["arguments"]) == {"city": "Paris"}
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text == "The user wants the weather."


def test_a_message_to_a_built_in_tool_is_reasoning_not_a_call(tok):
    browse = THINK + '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>'
    message = whole(chat(tok), browse)["message"]
    assert "tool_calls" not in message and message["content"] is None
    assert message["reasoning_content"] == 'The user wants the weather.\n{"query": "x"}'
