"""``chat_template_kwargs`` (as vLLM): extra variables of the chat template on
``/v1/chat/completions`` and ``/tokenize``; one that names a template variable of its own, or a
value that is not an object, is a 400 naming it."""

from __future__ import annotations

import json

import pytest

from shared.openai_api.adapters import ChatAdapter
from shared.openai_api.errors import ApiError
from shared.openai_api.tokenize import TokenizeRequest, tokenize
from word_tokens import word_tokenizer

WORDS = ["<unk>", "user", "assistant", ":", "hi", "<think>", "</think>"]
# Qwen3's switch: with enable_thinking false the generation prompt holds an empty reasoning
QWEN3_LIKE = ("{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}"
              "{% if add_generation_prompt %}assistant :"
              "{% if enable_thinking is defined and enable_thinking is false %} <think> </think>{% endif %}"
              "{% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatAdapter:
    body = {"model": "m", "messages": MESSAGES, **fields}
    return ChatAdapter.from_json(json.dumps(body).encode(), word_tokenizer(WORDS, QWEN3_LIKE))


def text_of(api: ChatAdapter) -> str:
    return api.tokenizer.decode(api.prompt_ids(), skip_special_tokens=False)


def test_the_kwargs_reach_the_template():
    assert text_of(chat()) == "user : hi assistant :"
    assert text_of(chat(chat_template_kwargs={"enable_thinking": True})) == "user : hi assistant :"
    assert text_of(chat(chat_template_kwargs={"enable_thinking": False})) == "user : hi assistant : <think> </think>"
    tokenizer = word_tokenizer(WORDS, QWEN3_LIKE)
    assert tokenizer.apply_chat_template(MESSAGES, extra_variables={"enable_thinking": False}).endswith("</think>")
    with pytest.raises(ValueError, match="messages"):  # the tokenizer guards its own variables too
        tokenizer.apply_chat_template(MESSAGES, extra_variables={"messages": []})


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"])
def test_a_template_variable_of_its_own_is_a_400_naming_it(key):
    with pytest.raises(ApiError) as info:
        chat(chat_template_kwargs={key: 1})
    error = info.value.body()["error"]
    assert info.value.status == 400 and error["param"] == f"chat_template_kwargs.{key}", error
    assert error["type"] == "invalid_request_error" and key in error["message"]


@pytest.mark.parametrize("value", [["enable_thinking"], "enable_thinking", 1])
def test_kwargs_that_are_not_an_object_are_a_400(value):
    with pytest.raises(ApiError) as info:
        chat(chat_template_kwargs=value)
    assert info.value.status == 400 and info.value.param.startswith("chat_template_kwargs"), info.value.body()


def test_a_text_worker_model_refuses_the_kwargs_rather_than_dropping_them():
    assert chat().text_prompt() == (None, MESSAGES)
    with pytest.raises(ApiError) as info:
        chat(chat_template_kwargs={"enable_thinking": False}).text_prompt()
    assert (info.value.status, info.value.param) == (400, "chat_template_kwargs")


def test_completions_refuse_the_field():
    from shared.openai_api.adapters import CompletionAdapter
    with pytest.raises(ApiError) as info:
        CompletionAdapter.from_json(json.dumps({"model": "m", "prompt": "hi",
                                                "chat_template_kwargs": {}}).encode(), None)
    assert info.value.param == "chat_template_kwargs"


def test_tokenize_takes_the_kwargs_for_messages():
    tokenizer = word_tokenizer(WORDS, QWEN3_LIKE)

    def count(**fields) -> int:
        return tokenize(TokenizeRequest(**fields), tokenizer, None, max_chars=10_000)["count"]

    assert count(messages=MESSAGES, chat_template_kwargs={"enable_thinking": False}) == count(messages=MESSAGES) + 2
    with pytest.raises(ApiError) as info:
        count(messages=MESSAGES, chat_template_kwargs={"tools": []})
    assert (info.value.status, info.value.param) == (400, "chat_template_kwargs.tools")
    with pytest.raises(ApiError) as info:
        count(prompt="hi", chat_template_kwargs={"enable_thinking": False})
    assert (info.value.status, info.value.param) == (400, "chat_template_kwargs")


async def test_the_gateway_answers_a_collision_with_an_openai_error():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from services.gateway.server import errors_middleware

    async def completions(request: web.Request) -> web.Response:
        ChatAdapter.from_json(await request.read(), word_tokenizer(WORDS, QWEN3_LIKE))
        return web.json_response({})

    app = web.Application(middlewares=[errors_middleware(lambda status: None)])
    app.router.add_post("/v1/chat/completions", completions)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES,
                                                               "chat_template_kwargs": {"messages": []}})
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == "chat_template_kwargs.messages", error
