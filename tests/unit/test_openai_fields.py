"""Nothing a client sends is silently dropped: every parameter the official SDK can send is in a
table (implemented, ignored, or refused with a 400 naming it), unknown ones are refused, and the
table in docs/api.md is the code's. Plus the sampling fields' checks that need no model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from shared.engine.request import Request, SamplingParams
from shared.engine.sampler import Sampler
from shared.openai_api.adapters import Choice, parse_body
from shared.openai_api.errors import ApiError
from shared.openai_api.fields import CHAT_FIELDS, COMPLETION_FIELDS, RESPONSES_FIELDS, Status, markdown_table
from shared.openai_api.generate_request import choice_requests, resolve_model
from shared.openai_api.models import ChatCompletionRequest, CompletionRequest
from shared.protocol import GenerateRequest, SamplingParams as WireSampling
from services.gateway.server import best_choices
from shared.protocol import TokenLogprob

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": "m", "prompt": "x"}


def chat_error(**fields) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_body(json.dumps({**CHAT, **fields}).encode(), ChatCompletionRequest, CHAT_FIELDS)
    return info.value


def completion_error(**fields) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_body(json.dumps({**COMPLETION, **fields}).encode(), CompletionRequest, COMPLETION_FIELDS)
    return info.value


def test_every_sdk_parameter_has_a_status():
    sdk_chat = set(chat_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    sdk_completion = set(completion_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert sdk_chat - set(CHAT_FIELDS) == set()
    assert sdk_completion - set(COMPLETION_FIELDS) == set()


def test_the_docs_table_is_the_code_table():
    doc = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    assert markdown_table() in doc, "docs/api.md's parameter table is stale: paste fields.markdown_table()"


@pytest.mark.parametrize("fields", [{"audio": {"voice": "alloy", "format": "wav"}},
                                    {"modalities": ["text", "audio"]}, {"suffix_typo": 1},
                                    {"prediction": {"type": "content", "content": "x"}},
                                    {"store": True}, {"service_tier": "scale"}])
def test_refused_and_unknown_chat_parameters_are_400_naming_them(fields):
    err = chat_error(**fields)
    assert (err.status, err.param) == (400, next(iter(fields))), err.body()
    assert err.body()["error"]["param"] == next(iter(fields))


def test_off_values_of_refused_parameters_and_ignored_ones_are_accepted():
    body = parse_body(json.dumps({**CHAT, "modalities": ["text"], "store": False, "service_tier": "auto",
                                  "user": "u", "metadata": {"k": "v"}, "tool_choice": "none",
                                  "response_format": {"type": "text"}}).encode(),
                      ChatCompletionRequest, CHAT_FIELDS)
    assert body.user == "u"
    refused = [n for n, r in CHAT_FIELDS.items() if r.status is Status.REFUSED]
    assert refused and all(CHAT_FIELDS[n].accepts(None) for n in refused)  # an explicit null is absent


def test_reasoning_effort_and_verbosity_are_accepted_on_chat():
    """Agent frameworks send them to any model: accepted (nothing changes here), a value OpenAI
    would refuse is still a 400 naming the parameter."""
    body = parse_body(json.dumps({**CHAT, "reasoning_effort": "high", "verbosity": "low"}).encode(),
                      ChatCompletionRequest, CHAT_FIELDS)
    assert (body.reasoning_effort, body.verbosity) == ("high", "low")
    assert chat_error(reasoning_effort="extreme").param == "reasoning_effort"
    assert chat_error(verbosity="terse").param == "verbosity"


def test_completion_combinations():
    assert completion_error(suffix="x").param == "suffix"
    assert completion_error(best_of=1, n=2).param == "best_of"
    assert completion_error(best_of=3, n=1, stream=True).param == "best_of"
    assert completion_error(echo=True, logprobs=1).param == "echo"
    assert chat_error(top_logprobs=2).param == "top_logprobs"
    body = parse_body(json.dumps({**COMPLETION, "best_of": 3, "n": 2}).encode(), CompletionRequest,
                      COMPLETION_FIELDS)
    assert body.num_choices() == 3


def test_model_may_be_omitted_when_one_is_served():
    assert resolve_model(None, ["only"]) == "only"
    with pytest.raises(ApiError) as info:
        resolve_model(None, ["a", "b"])
    assert (info.value.status, info.value.param) == (400, "model")
    with pytest.raises(ApiError) as info:
        resolve_model("c", ["a", "b"])
    assert (info.value.status, info.value.code) == (404, "model_not_found")


def test_choices_are_requests_with_the_same_prompt_and_distinct_seeds():
    req = GenerateRequest(request_id="r", model="m", prompt_token_ids=[1, 2, 3],
                          sampling=WireSampling(seed=7))
    reqs = choice_requests(req, 3)
    assert [r.request_id for r in reqs] == ["r-0", "r-1", "r-2"]
    assert [r.sampling.seed for r in reqs] == [7, 8, 9]
    assert all(r.prompt_token_ids == [1, 2, 3] for r in reqs)
    assert choice_requests(req, 1) == [req]


def test_best_of_keeps_the_highest_mean_logprob():
    def choice(text, *logprobs):
        return Choice(text, "stop", [TokenLogprob(token_id=0, logprob=lp) for lp in logprobs])
    picked = best_choices([choice("a", -3.0), choice("b", -0.5, -1.5), choice("c", -0.1)], 2)
    assert [c.text for c in picked] == ["c", "b"]


def test_logit_bias_bans_and_boosts_in_the_sampler():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    top = int(logits[0].argmax())
    greedy = Request("a", [1], SamplingParams(temperature=0.0, logit_bias={top: -100.0}))
    sampled = Request("b", [1], SamplingParams(temperature=1.0, logit_bias={top: -100.0}, logprobs=0))
    boosted = Request("c", [1], SamplingParams(temperature=0.0, logit_bias={17: 100.0}))
    sampler = Sampler(torch.device("cpu"))
    for _ in range(50):
        out = sampler.sample(torch.stack([logits[0]] * 3), [greedy, sampled, boosted])
        assert out[0].token_id != top and out[1].token_id != top and out[2].token_id == 17
    with pytest.raises(Exception, match="logit_bias"):
        SamplingParams(logit_bias={50: 1.0}).validate(vocab_size=50)


@pytest.mark.parametrize("body,param", [
    # instructor 1.3 sends the schema beside the type
    ({"response_format": {"type": "json_object", "schema": {"type": "object"}}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strictness": 1}}},
     "response_format.json_schema.strictness"),
    ({"stream_options": {"include_usage": True, "usage": True}}, "stream_options.usage"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameter": {}}}]}, "tools.0.function.parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f", "arguments": "{}"}}},
     "tool_choice.NamedToolChoice.function.arguments"),
])
def test_unknown_nested_fields_are_400_naming_the_path(body, param):
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], **body}).encode()
    with pytest.raises(ApiError) as info:
        parse_body(raw, ChatCompletionRequest, CHAT_FIELDS)
    err = info.value
    assert (err.status, err.param, err.code) == (400, param, "unrecognized_parameter"), err.body()
    assert err.message.startswith(f"{param}: unknown field")


def test_unknown_nested_fields_of_responses_are_400_naming_the_path():
    from shared.openai_api.responses_api import ResponsesRequest
    for body, param in (({"text": {"verbosity": "medium", "tone": "dry"}}, "text.tone"),
                        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "json_schema": {}}}},
                         "text.format.json_schema"),
                        ({"tools": [{"type": "function", "name": "f", "parameters": {}, "extra": 1}]}, "tools.0.extra")):
        with pytest.raises(ApiError) as info:
            parse_body(json.dumps({"model": "m", "input": "x", **body}).encode(), ResponsesRequest, RESPONSES_FIELDS)
        assert (info.value.param, info.value.code) == (param, "unrecognized_parameter"), info.value.body()
    # what the SDK sends back of its own output items (annotations, logprobs, ids) stays accepted
    echoed = [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]}]
    parse_body(json.dumps({"model": "m", "input": echoed}).encode(), ResponsesRequest, RESPONSES_FIELDS)


@pytest.mark.parametrize("endpoint,body,param", [
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "messages[0].content[1]"),
    ("chat", {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, "messages[1].content[0]"),
    ("responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}, "input[0].content[1]"),
])
def test_image_and_audio_parts_are_400_saying_so(endpoint, body, param):
    from shared.openai_api.responses_api import ResponsesRequest
    body_type, rules = ((ChatCompletionRequest, CHAT_FIELDS) if endpoint == "chat"
                        else (ResponsesRequest, RESPONSES_FIELDS))
    with pytest.raises(ApiError) as info:
        parse_body(json.dumps({"model": "m", **body}).encode(), body_type, rules)
    err = info.value
    assert (err.status, err.param) == (400, param) and "not supported by this server" in err.message, err.body()


async def test_embeddings_and_other_unserved_endpoints_say_they_are_not_supported():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from services.gateway.server import errors_middleware
    from services.gateway.unsupported import add_unsupported_routes
    app = web.Application(middlewares=[errors_middleware(lambda status: None)])
    add_unsupported_routes(app)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/v1/embeddings", json={"model": "m", "input": "hello"})
        body = await resp.json()
        assert resp.status == 404 and body["error"]["code"] == "unsupported_endpoint"
        assert body["error"]["message"].startswith("embeddings (/v1/embeddings) is not supported by this server")
        resp = await client.get("/elsewhere")  # outside /v1/: a plain 404
        assert resp.status == 404 and (await resp.json())["error"]["message"] == "Not Found"


async def test_every_unserved_v1_path_or_method_is_a_404_saying_so():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from services.gateway.server import errors_middleware
    from services.gateway.unsupported import add_unsupported_routes

    async def own_404(request):  # a handler's own 404 (an unknown id) keeps its message
        raise web.HTTPNotFound(reason="no such thing")

    app = web.Application(middlewares=[errors_middleware(lambda status: None)])
    app.router.add_post("/v1/chat/completions", lambda request: web.json_response({}))
    app.router.add_get("/v1/things/{id}", own_404)
    add_unsupported_routes(app)
    async with TestClient(TestServer(app)) as client:
        for method, path in (("POST", "/v1/conversations"), ("GET", "/v1/conversations/c_1/items"),
                             ("DELETE", "/v1/vector_stores/vs_1"), ("GET", "/v1/chat/completions")):
            resp = await client.request(method, path, json={})
            error = (await resp.json())["error"]
            assert resp.status == 404 and error["code"] == "unsupported_endpoint", (method, path, error)
            assert error["message"].startswith(f"{method} {path} is not supported by this server"), error
        assert "(this path takes POST)" in error["message"]
        resp = await client.get("/v1/things/x")
        assert resp.status == 404 and (await resp.json())["error"]["message"] == "no such thing"
