"""Hostile request bodies, without a network: whatever a body holds, reading it is a 400 in OpenAI's
error format (never a 500 from a later reader), a batch input line Python cannot parse fails its
file naming the line (never a batch held in ``validating``), and a line that cannot be made a
request is that line's result at once (never a batch held in ``in_progress``). The same probes
against a running gateway are in tests/integration/test_gateway_limits.py."""

from __future__ import annotations

import json

import pytest

from services.gateway.batch_runner import execute
from shared.openai_api.adapters import ChatAdapter, CompletionAdapter
from shared.openai_api.batch.lines import parse_input
from shared.openai_api.errors import ApiError
from shared.openai_api.json_body import MAX_NUMBER_DIGITS, JsonRefused, load_json
from shared.openai_api.models import MAX_STOP, MAX_TOKEN_COUNT
from shared.openai_api.responses_api import ResponsesAdapter
from shared.protocol.batch import BatchLineRequest

CHAT = "/v1/chat/completions"
HUGE = "9" * (MAX_NUMBER_DIGITS + 700)  # 5,000 digits: int() refuses it with a plain ValueError


def chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **extra}


def with_number(body: dict, name: str, digits: str) -> str:
    """``body`` as JSON with ``name`` set to the integer ``digits`` (json.dumps cannot write it)."""
    return json.dumps(body)[:-1] + f', "{name}": {digits}}}'


# --- reading a body --------------------------------------------------------------------------------
def test_an_integer_past_the_digit_limit_is_refused_as_json_not_a_bare_value_error():
    with pytest.raises(JsonRefused, match=f"more than {MAX_NUMBER_DIGITS} digits"):
        load_json(with_number(chat(), "max_tokens", HUGE))
    assert load_json(with_number(chat(), "x", "9" * MAX_NUMBER_DIGITS))["x"] > 0  # at the limit: read


@pytest.mark.parametrize("raw, param", [
    (r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages.0.content"),
    (r'{"prompt": "a\udfffb"}', "prompt"),
    (r'{"metadata": {"\ud800": "x"}}', "metadata"),  # a key
    (r'"\udc00"', None),
])
def test_a_lone_surrogate_is_refused_naming_where(raw, param):
    """``\\ud800`` parses into a str the tokenizer refuses with TypeError (a 500 on chat, responses
    and /tokenize)."""
    with pytest.raises(JsonRefused, match="lone surrogate") as refused:
        load_json(raw)
    assert refused.value.param == param
    assert load_json(raw, unicode_only=False) is not None
    assert load_json(r'{"prompt": "\ud83d\ude00"}') == {"prompt": "\N{GRINNING FACE}"}  # a pair is text


@pytest.mark.parametrize("adapter", [ChatAdapter, CompletionAdapter, ResponsesAdapter])
@pytest.mark.parametrize("name", ["max_tokens", "top_k"])
def test_a_huge_count_is_a_400_naming_it_on_every_endpoint(adapter, name):
    name = "max_output_tokens" if adapter is ResponsesAdapter and name == "max_tokens" else name
    prompt = {ChatAdapter: chat(), CompletionAdapter: {"prompt": "hi"}, ResponsesAdapter: {"input": "hi"}}[adapter]
    for digits in (str(MAX_TOKEN_COUNT + 1), "9" * 4000):  # 4,000 digits went through to the worker
        with pytest.raises(ApiError) as refused:
            adapter.from_json(with_number(prompt, name, digits).encode(), tokenizer=None)
        assert (refused.value.status, refused.value.param) == (400, name)
        assert len(refused.value.message) < 200
    with pytest.raises(ApiError) as refused:
        adapter.from_json(with_number(prompt, name, HUGE).encode(), tokenizer=None)
    assert (refused.value.status, refused.value.code) == (400, "invalid_json")
    assert "sys.set_int_max_str_digits" not in refused.value.message


@pytest.mark.parametrize("num_stops", [MAX_STOP + 1, 1000])
@pytest.mark.parametrize("adapter, prompt", [(ChatAdapter, chat()), (CompletionAdapter, {"prompt": "hi"})])
def test_too_many_stop_strings_says_what_the_limit_is(adapter, prompt, num_stops):
    """Was "stop.str: Input should be a valid string" (the union's first member)."""
    with pytest.raises(ApiError) as refused:
        adapter.from_json(json.dumps({**prompt, "stop": ["x"] * num_stops}).encode(), tokenizer=None)
    assert (refused.value.status, refused.value.param) == (400, "stop")
    assert f"at most {MAX_STOP} stop strings" in refused.value.message and f"got {num_stops}" in refused.value.message
    assert adapter.from_json(json.dumps({**prompt, "stop": ["x"] * MAX_STOP}).encode(), tokenizer=None)


# --- batch lines -------------------------------------------------------------------------------------
def batch_line(custom_id: str, body: dict | str) -> str:
    body_json = body if isinstance(body, str) else json.dumps(body)
    return f'{{"custom_id": "{custom_id}", "method": "POST", "url": "{CHAT}", "body": {body_json}}}'


def test_a_line_with_a_number_python_cannot_read_fails_the_file_naming_the_line():
    """Once a ValueError out of the sweep's validation: the batch stayed in validating for good."""
    data = "\n".join([batch_line("a", chat()), batch_line("b", with_number(chat(), "max_tokens", HUGE))]).encode()
    lines, errors = parse_input(data, CHAT, max_line_bytes=64 << 10)
    assert lines == [] and [(e.code, e.line) for e in errors] == [("invalid_json_line", 2)]
    assert f"more than {MAX_NUMBER_DIGITS} digits" in errors[0].message


class LocalGateway:
    """As much of a gateway as making a line's request uses; ``prepared_request`` raises
    ``failure`` (a bug met on the line's input) when given one."""

    tokenizer = None

    def __init__(self, failure: Exception | None = None) -> None:
        self.failure = failure

    async def prepared_request(self, *args):
        raise self.failure or AssertionError("the line should have been refused before")


def line_request(body: str) -> BatchLineRequest:
    return BatchLineRequest(batch_id="batch_1", line=2, custom_id="b", url=CHAT, body=body)


async def test_a_line_with_a_lone_surrogate_is_a_400_result_of_that_line():
    """Validation leaves the line to the endpoint (its custom_id is known); the endpoint's refusal
    is the line's result, where the tokenizer's TypeError once sent it back for redelivery."""
    raw = batch_line("b", r'{"messages": [{"role": "user", "content": "\ud800"}]}')
    lines, errors = parse_input(raw.encode(), CHAT, max_line_bytes=4096)
    assert errors == [] and len(lines) == 1
    outcome = await execute(LocalGateway(), line_request(lines[0].body), tier="default", priority=9)
    assert outcome.status == 400
    assert (outcome.body["error"]["code"], outcome.body["error"]["param"]) == ("invalid_json", "messages.0.content")


async def test_a_line_that_cannot_be_made_a_request_is_a_500_result_not_a_redelivery():
    """Parsing, the chat template and tokenization fail every delivery alike: raised, the line was
    delivered again every ack wait (30 s) up to max_deliver (20), holding the batch in_progress."""
    gateway = LocalGateway(failure=TypeError("TextInputSequence must be str"))
    outcome = await execute(gateway, line_request(json.dumps(chat())), tier="default", priority=9)
    assert outcome.status == 500
    assert outcome.body["error"] == {"message": "internal error: TypeError", "type": "internal_error",
                                     "param": None, "code": None}
