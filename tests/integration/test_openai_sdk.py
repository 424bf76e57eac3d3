"""The OpenAI API as clients use it, with the official ``openai`` SDK against a real stack on the
real SmolLM2: parameters refused with a 400 naming them, ``model`` omitted, ``/v1/models/{id}``,
``/tokenize``, ``logit_bias``, ``logprobs`` parsed by the SDK's types, ``echo``, and ``n`` whose
choices share the prompt's KV blocks. One stack (one decode worker) for the module."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
import uuid

import openai
import pytest

from stack_helpers import cluster_status, read_events, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def client(one_worker_stack):
    return openai.OpenAI(base_url=one_worker_stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(one_worker_stack, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(one_worker_stack.base_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


REFUSED = [("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
           ("/v1/chat/completions", {"modalities": ["audio"]}, "modalities"),
           ("/v1/chat/completions", {"store": True}, "store"),
           ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
           ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
           ("/v1/chat/completions", {"no_such_parameter": 1}, "no_such_parameter"),
           ("/v1/chat/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
           ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
           ("/v1/completions", {"suffix": "x"}, "suffix"),
           ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
           ("/v1/completions", {"best_of": 1, "n": 2}, "best_of")]


@pytest.mark.parametrize("path,fields,param", REFUSED, ids=[r[2] for r in REFUSED])
def test_refused_parameters_are_400_naming_them(one_worker_stack, path, fields, param):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    status, body = post(one_worker_stack, path, {"model": MODEL, **base, **fields})
    assert status == 400 and body["error"]["param"] == param, body


def test_model_omitted_models_by_id_and_tokenize(one_worker_stack, client):
    status, body = post(one_worker_stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["model"] == MODEL, body
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["param"] == "model"
    status, tokens = post(one_worker_stack, "/tokenize", {"prompt": PROMPT})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 1024
    assert post(one_worker_stack, "/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": PROMPT})
    status, chat = post(one_worker_stack, "/tokenize", {"messages": [{"role": "user", "content": PROMPT}]})
    assert status == 200 and chat["count"] > tokens["count"]


def test_logprobs_parse_with_the_sdk_types(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == comp.choices[0].text and all(len(t) == 2 for t in lp.top_logprobs)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=1, stream=True))
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]


def test_echo_returns_the_prompt_first(client):
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert comp.choices[0].text.startswith(PROMPT) and len(comp.choices[0].text) > len(PROMPT)


def test_logit_bias_minus_100_bans_a_token(one_worker_stack, client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    banned_text = plain.choices[0].logprobs.tokens[0]
    banned_id = post(one_worker_stack, "/tokenize", {"prompt": banned_text})[1]["tokens"]
    assert len(banned_id) == 1, banned_id
    for temperature in (0.0, 1.0, 1.0):
        comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=temperature,
                                         logprobs=0, logit_bias={str(banned_id[0]): -100})
        assert banned_text not in comp.choices[0].logprobs.tokens, comp.choices[0].logprobs.tokens


def cached_prompt_tokens(one_worker_stack) -> int:
    return sum(w["load"]["num_cached_prompt_tokens_total"] for w in cluster_status(one_worker_stack)["workers"]
               if w["load"] and w["info"]["role"] == "decode")


def test_n_greedy_choices_are_identical_and_share_the_prompt_blocks(one_worker_stack, client):
    workers = wait_for(lambda: [w for w in cluster_status(one_worker_stack)["workers"] if w["load"]], 30,
                       "the decode worker and its load in /status")
    block_size = workers[0]["info"]["block_size"]
    prompt = f"{uuid.uuid4().hex} " + "Tell me a story about a cat and a dog. " * 12
    num_prompt = post(one_worker_stack, "/tokenize", {"prompt": prompt})[1]["count"]
    full_block_tokens = (num_prompt - 1) // block_size * block_size  # the last token is always computed
    before = cached_prompt_tokens(one_worker_stack)
    comp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=3,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in comp.choices] == [0, 1, 2]
    assert len({c.text for c in comp.choices}) == 1, [c.text for c in comp.choices]
    assert comp.usage.prompt_tokens == num_prompt  # counted once, as at OpenAI
    assert comp.usage.completion_tokens == 18
    # choices 1 and 2 read choice 0's prompt blocks from the prefix cache instead of computing them
    wait_for(lambda: cached_prompt_tokens(one_worker_stack) - before >= 2 * full_block_tokens, 30,
             f"2 x {full_block_tokens} cached prompt tokens (from {before})")


def test_n_choices_stream_with_their_index(one_worker_stack):
    req = urllib.request.Request(one_worker_stack.base_url + "/v1/chat/completions", method="POST", data=json.dumps({
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "n": 3, "stream": True,
        "seed": 1}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = read_events(resp)
    finished = {c["index"] for e in events for c in e["choices"] if c["finish_reason"]}
    roles = {c["index"] for e in events for c in e["choices"] if c["delta"].get("role")}
    assert finished == roles == {0, 1, 2}


def test_best_of_returns_n_choices(client):
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1.0,
                                     best_of=3, n=2, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in comp.choices] == [0, 1]
    assert comp.usage.completion_tokens == 12  # all three runs count, not only the two returned


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}
ASKS = ["Describe a person.", "Who lives in Rome? Answer in JSON.", "Invent a character for a story."]


def test_json_schema_output_parses_and_validates(client):
    from concurrent.futures import ThreadPoolExecutor

    from schema_check import violation

    def ask(args):
        content, temperature = args
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=80, temperature=temperature,
            seed=5, response_format={"type": "json_schema",
                                     "json_schema": {"name": "person", "schema": PERSON, "strict": True}})

    with ThreadPoolExecutor(6) as pool:  # together, so the masks of a whole batch are computed at once
        replies = list(pool.map(ask, [(c, t) for c in ASKS for t in (0.0, 1.0)]))
    for reply in replies:
        assert reply.choices[0].finish_reason == "stop", reply
        value = json.loads(reply.choices[0].message.content)
        assert violation(value, PERSON) is None, (value, violation(value, PERSON))


def test_sdk_parse_json_object_and_regex(client):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Name a city."}],
                                           response_format=City, max_tokens=60, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, City)
    obj = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Give a JSON object with the key "city" set to "Paris".'}],
        response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content  # not cut at max_tokens
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    code = client.completions.create(model=MODEL, prompt="Flight number:", max_tokens=10, temperature=1.0,
                                     extra_body={"guided_regex": r"[A-Z]{2}[0-9]{3,4}"})
    assert re.fullmatch(r"[A-Z]{2}[0-9]{3,4}", code.choices[0].text), code.choices[0].text


def test_unsupported_schema_feature_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": {"if": {"type": "string"}, "then": {}}}})
    assert info.value.body["param"] == "response_format" and "if" in info.value.body["message"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "properties": {"city": {"type": "string", "maxLength": 30}},
                                                           "required": ["city"]}}}
# no additional properties: a schema that allows any keys lets a small model write arguments forever
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


def test_named_tool_choice_always_yields_a_valid_call_of_that_function(client):
    from concurrent.futures import ThreadPoolExecutor

    from schema_check import violation

    def ask(args):
        content, temperature = args
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], tools=[WEATHER, TIME], max_tokens=60,
            temperature=temperature, tool_choice={"type": "function", "function": {"name": "get_weather"}})

    asks = ["What is the weather in Paris?", "Is it raining in Oslo?", "Tell me a joke."]
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(ask, [(c, t) for c in asks for t in (0.0, 1.0)]))
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather" and call.id.startswith("call_")
            arguments = json.loads(call.function.arguments)
            assert violation(arguments, WEATHER["function"]["parameters"]) is None, arguments


def test_required_tool_call_streams_as_deltas_and_tool_results_are_accepted(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What time is it?"}], tools=[WEATHER, TIME],
        tool_choice="required", parallel_tool_calls=False, max_tokens=100, temperature=0, stream=True))
    deltas = [d for ch in chunks for c in ch.choices for d in (c.delta.tool_calls or [])]
    finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert finish == ["tool_calls"] and len(deltas) == 1 and deltas[0].function.name in ("get_weather", "get_time")
    call = deltas[0]
    follow_up = client.chat.completions.create(model=MODEL, tools=[WEATHER, TIME], max_tokens=20, temperature=0,
                                               messages=[{"role": "user", "content": "What time is it?"},
                                                         {"role": "assistant", "tool_calls": [{
                                                             "id": call.id, "type": "function",
                                                             "function": {"name": call.function.name,
                                                                          "arguments": call.function.arguments}}]},
                                                         {"role": "tool", "tool_call_id": call.id, "content": "12:00"}])
    # the tool-role message and the assistant's call are accepted in the history (else a 400 raises)
    assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_responses_api_streams_and_completes(client):
    reply = client.responses.create(model=MODEL, input="Name a colour.", instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)
    assert reply.status in ("completed", "incomplete") and reply.output_text and reply.usage.output_tokens <= 8
    events = list(client.responses.create(model=MODEL, input="Name a colour.", instructions="Be brief.",
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{reply.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    assert events[-1].response.output_text == reply.output_text
    structured = client.responses.create(
        model=MODEL, input='Give a JSON object with the key "city" set to "Paris".', max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "strict": True, "schema": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
            "additionalProperties": False}}})
    assert set(json.loads(structured.output_text)) == {"city"}
