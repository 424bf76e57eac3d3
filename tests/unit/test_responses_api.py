"""``/v1/responses`` without a server: the request's parameters, its prompt, and the response
and streamed events as the official SDK's types read them."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, response_create_params
from pydantic import TypeAdapter
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from shared.openai_api.adapters import Choice, Delta, ResponseHead
from shared.openai_api.errors import ApiError
from shared.openai_api.fields import RESPONSES_FIELDS
from shared.openai_api.responses import usage
from shared.openai_api.responses_api import ResponsesAdapter
from shared.tokenizer import Tokenizer

WORDS = ["<unk>", "system", "user", "assistant", ":", "be", "brief", "hello", "world", "{", "}"]
TEMPLATE = "{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}assistant :"
HEAD = ResponseHead("resp-abc", 7, "m")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    backend = BackendTokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend, bos_token=None, eos_token=None, chat_template=TEMPLATE)


def adapter(tok, **fields) -> ResponsesAdapter:
    return ResponsesAdapter.from_json(json.dumps({"model": "m", "input": "hello world", **fields}).encode(), tok)


def test_every_sdk_parameter_has_a_status():
    assert set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"} <= set(RESPONSES_FIELDS)


def test_prompt_and_refusals(tok):
    api = adapter(tok, instructions="be brief")
    assert api.prompt_ids() == tok.encode("system : be brief user : hello world assistant :")
    listed = adapter(tok, input=[{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}])
    assert listed.prompt_ids() == tok.encode("user : hello assistant :")
    for fields, param in (({"previous_response_id": "r"}, "previous_response_id"), ({"store": True}, "store"),
                          ({"n": 2}, "n"), ({"text": {"format": {"type": "xml"}}}, "text.format.type")):
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
