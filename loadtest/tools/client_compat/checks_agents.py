"""openai-agents: an ``Agent`` given a model name (and short greedy model settings) run by
``Runner``, the SDK's default client set to one for the gateway (its docs' way to use another
provider); its chat-completions model, function tools, ``output_type``, ``previous_response_id``,
``OpenAIConversationsSession`` and ``conversation_id``."""

from __future__ import annotations

import asyncio

from loadtest.tools.client_compat.base import (CITY_PROMPT, FIRST_TURN, SECOND_TURN, SHORT_WEATHER_PROMPT, TIMEOUT_S,
                                               City, Client, Target, distribution, expect)


def _default_client(t: Target):
    """An ``AsyncOpenAI`` for the gateway made the SDK's default, tracing off (it would export to
    OpenAI): the SDK's documented set-up for another provider. Made inside the event loop that
    uses it (its connections belong to that loop)."""
    import agents
    import openai

    client = openai.AsyncOpenAI(base_url=t.v1, api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_tracing_disabled(True)
    return client


def _agent_run(t: Target, build, prompt: str = "Say hello.", streamed: bool = False, **run_kwargs):
    """``Runner.run`` (or ``run_streamed``) of ``build(client)``'s agent, in an event loop of its own."""
    import agents

    async def main():
        client = _default_client(t)
        agent = build(client)
        if streamed:
            result = agents.Runner.run_streamed(agent, prompt, max_turns=3, **run_kwargs)
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, prompt, max_turns=3, **run_kwargs)
        await client.close()
        return result

    return asyncio.run(main())


# openai-agents takes a response cut off by max_output_tokens for a model failure (ModelBehaviorError),
# as it would OpenAI's: room enough for a small model to end its answer
AGENT_MAX_TOKENS = 200


def _agent(t: Target, **kwargs):
    from agents import Agent, ModelSettings

    return Agent(name="assistant", instructions="You are a helpful assistant.", model=t.model,
                 model_settings=kwargs.pop("model_settings", ModelSettings(max_tokens=AGENT_MAX_TOKENS, temperature=0)),
                 **kwargs)


def _weather_tool():
    from agents import function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return f"Sunny in {city}"
    return get_weather


def agents_responses(t: Target) -> None:
    result = _agent_run(t, lambda _: _agent(t))
    expect(isinstance(result.final_output, str) and result.final_output, f"output: {result.final_output!r}")


def agents_stream(t: Target) -> None:
    result = _agent_run(t, lambda _: _agent(t), streamed=True)
    expect(isinstance(result.final_output, str) and result.final_output, f"output: {result.final_output!r}")


def agents_chat(t: Target) -> None:
    from agents import OpenAIChatCompletionsModel

    def build(client):
        return _agent(t).clone(model=OpenAIChatCompletionsModel(model=t.model, openai_client=client))
    result = _agent_run(t, build)
    expect(isinstance(result.final_output, str) and result.final_output, f"output: {result.final_output!r}")


def _agents_tools(t: Target, tool_choice: str) -> None:
    from agents import ModelSettings

    settings = ModelSettings(tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=AGENT_MAX_TOKENS,
                             temperature=0)
    result = _agent_run(t, lambda _: _agent(t, tools=[_weather_tool()], model_settings=settings,
                                            tool_use_behavior="stop_on_first_tool"), SHORT_WEATHER_PROMPT)
    expect(isinstance(result.final_output, str), f"output: {result.final_output!r}")
    if tool_choice == "required":
        expect(result.final_output.startswith("Sunny in "), f"the tool's output: {result.final_output!r}")


def agents_structured(t: Target) -> None:
    result = _agent_run(t, lambda _: _agent(t, output_type=City), CITY_PROMPT)
    expect(isinstance(result.final_output, City), f"output: {result.final_output!r}")


def agents_stored(t: Target) -> None:
    first = _agent_run(t, lambda _: _agent(t), FIRST_TURN)
    second = _agent_run(t, lambda _: _agent(t), SECOND_TURN, previous_response_id=first.last_response_id)
    expect(second.last_response_id and second.last_response_id != first.last_response_id, "no second response")


def agents_conversations(t: Target) -> None:
    """``OpenAIConversationsSession`` over two runs, then ``Runner.run(conversation_id=...)``."""
    import agents

    async def main():
        client = _default_client(t)
        session = agents.OpenAIConversationsSession(openai_client=client)
        for prompt in (FIRST_TURN, SECOND_TURN):
            await agents.Runner.run(_agent(t), prompt, session=session)
        conversation = await client.conversations.create()
        for prompt in (FIRST_TURN, SECOND_TURN):
            await agents.Runner.run(_agent(t), prompt, conversation_id=conversation.id)
        items = await session.get_items(), (await client.conversations.items.list(conversation.id)).data
        await client.close()
        return items

    session_items, conversation_items = asyncio.run(main())
    expect(len(session_items) >= 4, f"{len(session_items)} items in the session's conversation")
    expect(len(conversation_items) >= 4, f"{len(conversation_items)} items in the conversation")


CLIENT = Client("openai-agents", distribution("openai-agents"), {
    "chat": agents_chat, "stream": agents_stream, "tools_forced": lambda t: _agents_tools(t, "required"),
    "tools_auto": lambda t: _agents_tools(t, "auto"), "structured": agents_structured,
    "responses": agents_responses, "stored": agents_stored, "conversations": agents_conversations})
