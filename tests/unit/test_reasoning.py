"""The reasoning splitter: ``<think>…</think>`` apart from the answer, streamed or whole; and where
the chat and Responses adapters put it."""

import json

import pytest
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from shared.openai_api.adapters import ChatAdapter, Choice, Delta, ResponseHead
from shared.openai_api.reasoning import ReasoningSplitter, Start, reasoning_start, split_reasoning
from shared.openai_api.responses import usage
from shared.openai_api.responses_api import ResponsesAdapter
from shared.protocol import GenerateRequest
from word_tokens import word_tokenizer

QWEN = "<think>\nThe capital of France is Paris.\n</think>\n\nParis."
R1 = "The user asks for a <b>capital</b>.\n</think>\n\nParis."


def streamed(text: str, start: Start | None, cuts: list[int]) -> tuple[str, str, list[tuple[str, str]]]:
    """``text`` fed in pieces cut at ``cuts``: the reasoning, the content and every piece's pair."""
    splitter = ReasoningSplitter(start)
    bounds = [0, *cuts, len(text)]
    pairs = [splitter.push(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [splitter.flush()]
    return "".join(r for r, _ in pairs), "".join(c for _, c in pairs), pairs


def one_cut_and_two(text: str) -> list[list[int]]:
    """Every cut into two pieces, and every cut into three around each tag's characters."""
    cuts = [[i] for i in range(1, len(text))]
    return cuts + [[i, j] for i in range(1, len(text)) for j in range(i + 1, min(i + 10, len(text)))]


@pytest.mark.parametrize("text,start,reasoning,content", [
    (QWEN, Start.OUTPUT, "\nThe capital of France is Paris.\n", "Paris."),
    (R1, Start.PROMPT, "The user asks for a <b>capital</b>.\n", "Paris."),
    ("  <think>hm</think>ok", Start.OUTPUT, "hm", "  ok"),  # text before the opening tag is content
    ("<think>a</think>", Start.OUTPUT, "a", ""),
    ("</think>\n\nonly an answer", Start.PROMPT, "", "only an answer"),
])
def test_every_chunk_boundary_gives_the_whole_texts_split(text, start, reasoning, content):
    assert split_reasoning(text, start) == (reasoning, content)
    for cuts in one_cut_and_two(text):
        got_reasoning, got_content, _ = streamed(text, start, cuts)
        assert (got_reasoning, got_content) == (reasoning, content), cuts


def test_a_tag_is_never_emitted_in_part():
    for cuts in one_cut_and_two(QWEN):
        _, _, pairs = streamed(QWEN, Start.OUTPUT, cuts)
        for reasoning, content in pairs:
            for tag in ("<think>", "</think>"):
                assert not any(tag[:n] in (reasoning[-n:], content[-n:]) for n in range(2, len(tag) + 1)), (cuts, pairs)


def test_reasoning_streams_before_its_end_is_known():
    splitter = ReasoningSplitter(Start.OUTPUT)
    assert splitter.push("<think>first") == ("first", "")
    assert splitter.push(" second </th") == (" second ", "")
    assert splitter.is_reasoning
    assert splitter.push("ink>\n") == ("", "")
    assert splitter.push("  \n") == ("", "")  # whitespace after the closing tag is dropped
    assert splitter.push(" answer  ") == ("", "answer  ")
    assert splitter.push("</think> <think>") == ("", "</think> <think>")  # the answer is not parsed again
    assert splitter.flush() == ("", "")


@pytest.mark.parametrize("start,text", [(Start.OUTPUT, "<think>still thinking when max_tokens came </thi"),
                                        (Start.PROMPT, "still thinking when max_tokens came </thi")])
def test_output_cut_off_inside_the_reasoning_is_all_reasoning(start, text):
    expected = ("still thinking when max_tokens came </thi", "")
    assert split_reasoning(text, start) == expected
    for cuts in one_cut_and_two(text):
        assert streamed(text, start, cuts)[:2] == expected, cuts


@pytest.mark.parametrize("text", ["Paris.", "a <thin b", "I use </think> tags", "<thi", ""])
def test_output_without_an_opening_tag_stays_content(text):
    assert split_reasoning(text, Start.OUTPUT) == ("", text)
    assert split_reasoning(text, None) == ("", text)
    for cuts in one_cut_and_two(text):
        assert streamed(text, Start.OUTPUT, cuts)[:2] == ("", text), cuts


def test_without_a_start_nothing_is_held_back():
    splitter = ReasoningSplitter(None)
    assert splitter.push("<think>") == ("", "<think>")
    assert splitter.push("x</think>") == ("", "x</think>")


TEMPLATE = "{% if m.reasoning %}<think>{{ m.reasoning }}</think>{% endif %}"


@pytest.mark.parametrize("parser,uses_template,template,prompt_end,start", [
    ("auto", True, TEMPLATE, "<|im_start|>assistant\n", Start.OUTPUT),
    ("auto", True, TEMPLATE, "<｜Assistant｜><think>\n", Start.PROMPT),
    ("auto", True, "{{ messages }}", "<|im_start|>assistant\n", None),  # not a thinking model's template
    ("auto", True, None, None, None),  # no template here (a text worker's model)
    ("think", True, None, None, Start.OUTPUT),
    ("think", True, None, "<think>\n\n", Start.PROMPT),
    ("think", False, TEMPLATE, "<think>", None),  # /v1/completions: never
    ("none", True, TEMPLATE, "<think>", None),
    ("auto", True, "<|start|>{{ m.role }}<|channel|>final", "<|start|>assistant", Start.HARMONY),  # gpt-oss
    ("harmony", True, None, None, Start.HARMONY),
    ("harmony", False, None, None, None),
])
def test_when_the_output_is_split(parser, uses_template, template, prompt_end, start):
    assert reasoning_start(parser, uses_template=uses_template, template=template, prompt_end=prompt_end) is start


# --- the adapters: where the reasoning goes in each API's answer --------------------------------

WORDS = ["<unk>", "user", "assistant", ":", "hi", "<think>"]
# a DeepSeek-R1-like template: the generation prompt opens the reasoning; earlier turns' is cut
R1_TEMPLATE = ("{% for m in messages %}{{ m.role }} : {{ m.content.split('</think>')[-1] }} {% endfor %}"
               "assistant : <think>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>'
HEAD = ResponseHead("chatcmpl-abc", 7, "m")


def chat_api(template: str = R1_TEMPLATE, **fields) -> ChatAdapter:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatAdapter.from_json(json.dumps(body).encode(), word_tokenizer(WORDS, template))


def generate_request(api) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", prompt_token_ids=api.prompt_ids())


def test_the_rendered_prompt_decides_the_start_and_a_grammar_from_the_first_token_turns_it_off():
    api = chat_api()
    assert api.decide_reasoning("auto", generate_request(api)) is Start.PROMPT
    api = chat_api("{% for m in messages %}{{ m.content }} {% endfor %}{% if x %}</think>{% endif %}")
    assert api.decide_reasoning("auto", generate_request(api)) is Start.OUTPUT
    api = chat_api("{% for m in messages %}{{ m.content }} {% endfor %}")
    assert api.decide_reasoning("auto", generate_request(api)) is None
    assert api.decide_reasoning("think", generate_request(api)) is Start.OUTPUT
    api = chat_api(response_format={"type": "json_object"})
    assert api.decide_reasoning("think", generate_request(api)) is None and api.reasoning is None
    api = chat_api(tools=[WEATHER])  # auto: free text (the reasoning) may come before a call
    assert api.decide_reasoning("auto", generate_request(api)) is Start.PROMPT
    api = chat_api(tools=[WEATHER], tool_choice="required")
    assert api.decide_reasoning("auto", generate_request(api)) is None


def test_a_chat_tool_call_after_reasoning():
    api = chat_api(tools=[WEATHER], stream=True)
    chunks = api.stream_chunks(HEAD, 0, Delta("", [], None, "Oslo, then"), 0)
    chunks += api.stream_chunks(HEAD, 0, Delta(CALL[:20], [], None, " the weather."), 0)
    chunks += api.stream_chunks(HEAD, 0, Delta(CALL[20:], [], "stop"), 0)
    typed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    deltas = [c.choices[0].delta for c in typed]
    assert [getattr(d, "reasoning_content", None) for d in deltas[:2]] == ["Oslo, then", " the weather."]
    assert deltas[2].tool_calls[0].function.name == "get_weather"
    assert typed[-1].choices[0].finish_reason == "tool_calls"
    message = api.choice(0, Choice(CALL, "stop", [], "Oslo, then the weather."))["message"]
    assert message["reasoning_content"] == "Oslo, then the weather." and message["tool_calls"]


def test_a_response_call_after_reasoning_comes_after_the_reasoning_item():
    api = ResponsesAdapter.from_json(json.dumps({"model": "m", "input": "hi", "tools": [
        {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}], "stream": True}).encode(),
        word_tokenizer(WORDS, R1_TEMPLATE))
    api.decide_reasoning("auto", generate_request(api))
    head = ResponseHead("resp-abc", 7, "m")
    events = [*api.opening_chunks(head, 0)]
    events += api.stream_chunks(head, 0, Delta("", [], None, "weather?"), 0)
    events += api.stream_chunks(head, 0, Delta(CALL, [], "stop"), 0)
    events += api.closing_chunks(head, usage(3, 5, 0))
    typed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.type for e in typed][2:] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.output_index for e in typed if e.type == "response.output_item.added"] == [0, 1]
    done = typed[-1].response
    assert [o.type for o in done.output] == ["reasoning", "function_call"]
    whole = api.response(head, [api.choice(0, Choice(CALL, "stop", [], "weather?"))], usage(3, 5, 0))
    assert [o.type for o in Response.model_validate(whole).output] == ["reasoning", "function_call"]


def test_reasoning_items_sent_back_are_left_out_of_the_prompt():
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "secret"}]}
    body = {"model": "m", "input": [{"role": "user", "content": "hi"}, reasoning,
                                    {"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]}
    api = ResponsesAdapter.from_json(json.dumps(body).encode(), word_tokenizer(WORDS, R1_TEMPLATE))
    assert [m["role"] for m in api.body.messages()] == ["user", "assistant", "user"]
    continued = api.body.continued([reasoning, {"type": "message", "role": "user", "content": "hi"}])
    assert [m["role"] for m in continued.messages()] == ["user", "user", "assistant", "user"]
