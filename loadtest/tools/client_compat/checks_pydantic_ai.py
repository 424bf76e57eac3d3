"""pydantic-ai's ``Agent`` on its OpenAI chat and Responses models, with an ``OpenAIProvider`` for the
gateway."""

from __future__ import annotations

import asyncio

from loadtest.tools.client_compat.base import (CITY_PROMPT, FIRST_TURN, SECOND_TURN, TIMEOUT_S, WEATHER_PROMPT, City,
                                               Client, Target, distribution, expect, openai_client)


def _pydantic_agent(t: Target, responses: bool = False, **kwargs):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=t.v1, api_key="unused")
    model = (OpenAIResponsesModel if responses else OpenAIChatModel)(t.model, provider=provider)
    settings = {"max_tokens": kwargs.pop("max_tokens", 24), "temperature": 0, "timeout": TIMEOUT_S}
    return Agent(model, model_settings=settings, **kwargs)


def pydantic_chat(t: Target) -> None:
    output = _pydantic_agent(t).run_sync("Say hello.").output
    expect(isinstance(output, str) and output, f"output: {output!r}")


def pydantic_stream(t: Target) -> None:
    async def main():
        async with _pydantic_agent(t).run_stream("Say hello.") as run:
            return [text async for text in run.stream_text(delta=True)]
    expect("".join(asyncio.run(main())), "no text streamed")


def pydantic_tools_auto(t: Target) -> None:
    from pydantic_ai.usage import UsageLimits

    agent = _pydantic_agent(t, max_tokens=60)

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return f"Sunny in {city}"

    output = agent.run_sync(WEATHER_PROMPT, usage_limits=UsageLimits(request_limit=3)).output
    expect(isinstance(output, str), f"output: {output!r}")


def pydantic_structured(t: Target) -> None:
    """Its default structured output: a forced call of the output tool it declares."""
    output = _pydantic_agent(t, max_tokens=60, output_type=City).run_sync(CITY_PROMPT).output
    expect(isinstance(output, City), f"output: {output!r}")


def pydantic_responses(t: Target) -> None:
    output = _pydantic_agent(t, responses=True).run_sync("Say hello.").output
    expect(isinstance(output, str) and output, f"output: {output!r}")


def pydantic_stored(t: Target) -> None:
    """``openai_previous_response_id`` set to the first run's response: the second run sends that id
    and its own prompt, not the first run's messages."""
    agent = _pydantic_agent(t, responses=True)
    first = agent.run_sync(FIRST_TURN).response.provider_response_id
    second = agent.run_sync(SECOND_TURN, model_settings={"openai_previous_response_id": first})
    expect(isinstance(second.output, str) and second.output, f"output: {second.output!r}")
    stored = openai_client(t).responses.retrieve(second.response.provider_response_id)
    expect(stored.previous_response_id == first, f"second run's previous_response_id: {stored.previous_response_id}")


# no forced-tool row: pydantic-ai forces a call only of its output tool, which is its structured output
CLIENT = Client("pydantic-ai", distribution("pydantic-ai-slim"), {
    "chat": pydantic_chat, "stream": pydantic_stream, "tools_auto": pydantic_tools_auto,
    "structured": pydantic_structured, "responses": pydantic_responses, "stored": pydantic_stored})
