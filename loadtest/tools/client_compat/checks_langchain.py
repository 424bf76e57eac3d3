"""langchain-openai's ``ChatOpenAI``: invoke, stream, ``bind_tools``, ``with_structured_output``, and
the Responses API (``use_responses_api``, ``use_previous_response_id``)."""

from __future__ import annotations

from loadtest.tools.client_compat.base import (CITY_PROMPT, FIRST_TURN, SECOND_TURN, TIMEOUT_S, WEATHER_PROMPT, City,
                                               Client, Target, distribution, expect, openai_client)


def _chat_openai(t: Target, max_tokens: int = 24, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=t.model, base_url=t.v1, api_key="unused", temperature=0, max_tokens=max_tokens,
                      max_retries=0, timeout=TIMEOUT_S, **kwargs)


def _langchain_weather():
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return f"Sunny in {city}"
    return get_weather


def langchain_chat(t: Target) -> None:
    reply = _chat_openai(t).invoke("Say hello.")
    expect(isinstance(reply.content, str) and reply.content, f"reply: {reply}")


def langchain_stream(t: Target) -> None:
    text = "".join(chunk.content for chunk in _chat_openai(t).stream("Say hello."))
    expect(text, "no text streamed")


def langchain_tools_forced(t: Target) -> None:
    llm = _chat_openai(t, 60).bind_tools([_langchain_weather()], tool_choice="any", parallel_tool_calls=False)
    reply = llm.invoke(WEATHER_PROMPT)
    expect(len(reply.tool_calls) == 1 and not reply.invalid_tool_calls, f"calls: {reply.tool_calls}, "
                                                                         f"invalid: {reply.invalid_tool_calls}")
    expect(reply.tool_calls[0]["name"] == "get_weather", f"call: {reply.tool_calls[0]}")


def langchain_tools_auto(t: Target) -> None:
    reply = _chat_openai(t, 60).bind_tools([_langchain_weather()]).invoke(WEATHER_PROMPT)
    expect(not reply.invalid_tool_calls and (reply.content or reply.tool_calls), f"reply: {reply}")


def langchain_structured(t: Target) -> None:
    city = _chat_openai(t, 60).with_structured_output(City).invoke(CITY_PROMPT)
    expect(isinstance(city, City), f"output: {city!r}")


def langchain_responses(t: Target) -> None:
    reply = _chat_openai(t, use_responses_api=True).invoke("Say hello.")
    expect(reply.text, f"reply: {reply}")


def langchain_stored(t: Target) -> None:
    """``use_previous_response_id``: the second turn sends only the new message and the first
    reply's id."""
    from langchain_core.messages import HumanMessage

    llm = _chat_openai(t, use_responses_api=True, use_previous_response_id=True)
    history = [HumanMessage(FIRST_TURN)]
    history.append(llm.invoke(history))
    second = llm.invoke([*history, HumanMessage(SECOND_TURN)])
    stored = openai_client(t).responses.retrieve(second.response_metadata["id"])
    expect(second.text and stored.previous_response_id == history[-1].response_metadata["id"],
           f"second turn's previous_response_id: {stored.previous_response_id}")


CLIENT = Client("langchain-openai", distribution("langchain-openai"), {
    "chat": langchain_chat, "stream": langchain_stream, "tools_forced": langchain_tools_forced,
    "tools_auto": langchain_tools_auto, "structured": langchain_structured, "responses": langchain_responses,
    "stored": langchain_stored})
