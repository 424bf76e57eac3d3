"""Tool-call markers that are special tokens (Mistral's ``[TOOL_CALLS]`` and ``[ARGS]``, Llama
3.1's ``<|python_tag|>``): the gateway's detokenizer skips special tokens, but keeps these for a
request with tools, so the parser sees them; the content never shows them. A tiny byte-level
tokenizer with those special tokens stands in for the families' own."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from shared.openai_api.adapters import ChatAdapter, Choice, Delta, ResponseHead
from shared.openai_api.responses import usage
from shared.openai_api.responses_api import ResponsesAdapter
from shared.tokenizer import IncrementalDetokenizer, Tokenizer

SPECIAL = ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "</s>"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HEAD = ResponseHead("chatcmpl-1", 1, "m")
PARIS = ("get_weather", {"city": "Paris"})


def byte_level_tokenizer(special: list[str], eos_token: str, chat_template: str | None = None) -> Tokenizer:
    """Byte-level, no merges: every byte a token, and ``special`` special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = BackendTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(special)
    return Tokenizer(backend, bos_token=None, eos_token=eos_token, chat_template=chat_template)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The markers special tokens."""
    return byte_level_tokenizer(SPECIAL, "</s>")


def chat(tok: Tokenizer, parser: str, **fields) -> ChatAdapter:
    api = ChatAdapter.from_json(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                            "tools": [WEATHER], **fields}).encode(), tok)
    api.decide_tool_format(parser)
    return api


def generated(tok: Tokenizer, text: str, kept: frozenset[int]) -> list[str]:
    """``text`` as the model would generate it (and EOS), detokenized a token at a time as the
    gateway does (``services.gateway.generation``)."""
    detok = IncrementalDetokenizer(tok, tok.encode("x"), kept_special_ids=kept)
    return [detok.push([i]) for i in tok.encode(text + "</s>")] + [detok.flush()]


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]


MISTRAL = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize("parser,output,markers", [
    ("mistral", MISTRAL, ["[TOOL_CALLS]", "[ARGS]"]),
    ("llama3_json", LLAMA, ["<|python_tag|>"]),
])
def test_special_token_markers_reach_the_parser(tok, parser, output, markers):
    api = chat(tok, parser)
    kept = api.kept_token_ids()
    assert kept == {tok.special_token_id(m) for m in markers}  # not </s>: other special tokens stay skipped
    text = "".join(generated(tok, output, kept))
    assert text == output
    choice = api.choice(0, Choice(text, "stop", []))
    assert calls_of(choice["message"]) == [PARIS] and choice["message"]["content"] is None
    assert choice["finish_reason"] == "tool_calls"
    # skipped as before, Mistral's call would read 'get_weather{"city": "Paris"}': text
    if parser == "mistral":
        skipped = "".join(generated(tok, output, frozenset()))
        assert skipped == 'get_weather{"city": "Paris"}' and api.body.tool_use().calls(skipped, "stop") is None


@pytest.mark.parametrize("parser,output", [("mistral", MISTRAL), ("llama3_json", LLAMA)])
def test_a_stream_of_special_token_markers_makes_tool_call_deltas(tok, parser, output):
    api = chat(tok, parser, stream=True)
    pieces = generated(tok, "Let me check. " + output, api.kept_token_ids())
    chunks = []
    for i, piece in enumerate(pieces):
        chunks += api.stream_chunks(HEAD, 0, Delta(piece, [], "stop" if i == len(pieces) - 1 else None), 0)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    assert calls_of(next(d for d in deltas if "tool_calls" in d)) == [PARIS]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_markers_never_show_in_the_content(tok):
    api = chat(tok, "mistral")
    text = "".join(generated(tok, "[TOOL_CALLS]no call here", api.kept_token_ids()))
    assert text == "[TOOL_CALLS]no call here"  # kept for the parser, which reads no call
    assert api.choice(0, Choice(text, "stop", []))["message"] == {"role": "assistant", "content": "no call here"}
    stream = chat(tok, "mistral", stream=True)
    chunks = stream.stream_chunks(HEAD, 0, Delta("[TOOL_CALLS]no call", [], None), 0)
    chunks += stream.stream_chunks(HEAD, 0, Delta(" here", [], "stop"), 0)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "no call here"
    # the Responses API reads the same output
    responses = ResponsesAdapter.from_json(json.dumps({"model": "m", "input": "x", "tools": [
        {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]}).encode(), tok)
    responses.decide_tool_format("mistral")
    body = responses.response(HEAD, [responses.choice(0, Choice(text, "stop", []))], usage(1, 2, 0))
    assert body["output"][0]["content"][0]["text"] == "no call here"
    body = responses.response(HEAD, [responses.choice(0, Choice(MISTRAL, "stop", []))], usage(1, 2, 0))
    assert [o["type"] for o in body["output"]] == ["function_call"]


def test_only_a_request_with_tools_keeps_markers_and_only_special_ones(tok):
    assert chat(tok, "mistral", tool_choice="none").kept_token_ids() == frozenset()
    no_tools = ChatAdapter.from_json(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]})
                                     .encode(), tok)
    no_tools.decide_tool_format("mistral")
    assert no_tools.kept_token_ids() == frozenset()
    # hermes' <tool_call> is no special token here (nor in Qwen's tokenizer): text as any, nothing kept
    assert chat(tok, "hermes").kept_token_ids() == frozenset()
    assert "".join(generated(tok, MISTRAL, frozenset())) == 'get_weather{"city": "Paris"}'


def test_the_detokenizer_keeps_only_the_kept_special_tokens(tok):
    ids = tok.encode("a[ARGS]b</s>c[TOOL_CALLS]")
    kept = frozenset({tok.special_token_id("[ARGS]")})
    for size in (1, 2, 5):
        detok = IncrementalDetokenizer(tok, kept_special_ids=kept)
        pieces = [detok.push(ids[i:i + size]) for i in range(0, len(ids), size)]
        assert "".join(pieces) + detok.flush() == "a[ARGS]bc"
    assert tok.special_token_id("a") is None and tok.special_token_id("[ARGS]") is not None
