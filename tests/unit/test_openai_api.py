import pytest
from pydantic import ValidationError

from shared.openai_api.errors import from_validation_error
from shared.openai_api.models import ChatCompletionRequest, CompletionRequest
from shared.openai_api.stop import StopStringMatcher


def stream(matcher, pieces):
    return "".join(matcher.push(p) for p in pieces) + matcher.flush()


@pytest.mark.parametrize("stops,pieces,expected,stopped", [
    ([], ["ab", "c"], "abc", False),
    (["END"], ["hello E", "N", "D more"], "hello ", True),
    (["END"], ["hello E", "N"], "hello EN", False),
    (["x", "yz"], ["aay", "zb"], "aa", True),
    (["\n\n"], ["a\n", "\nb"], "a", True),
    (["ab"], ["a", "a", "c"], "aac", False),
])
def test_stop_strings(stops, pieces, expected, stopped):
    m = StopStringMatcher(stops)
    assert stream(m, pieces) == expected
    assert m.is_stopped == stopped


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"model": "m", "messages": "hi"}, "messages"),
    ({"model": "", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 17}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}, "logit_bias"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": -101}}, "logit_bias"),
    # str.isdigit() admits "²", and int() refuses keys past 4,300 digits: both once were 500s
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"²": 1}}, "logit_bias"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"1234567890": 1}}, "logit_bias"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": list("abcde")}, "stop"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
])
def test_chat_validation_names_the_parameter(body, param):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    err = from_validation_error(info.value)
    assert err.status == 400 and err.param.startswith(param), err.body()


def test_valid_requests_and_defaults():
    chat = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2, "stop": "x",
        "stream_options": {"include_usage": True}})
    assert (chat.requested_max_tokens(), chat.num_logprobs(), chat.stop_strings()) == (3, 2, ["x"])
    assert chat.include_usage() and chat.messages[0].text() == "hi"
    comp = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3]})
    assert comp.requested_max_tokens() == 16 and comp.num_logprobs() is None
