"""The official openai Python SDK: every feature, as its README and API reference show them."""

from __future__ import annotations

import json

from loadtest.tools.client_compat.base import (CHAT_WEATHER, CITY_PROMPT, RESPONSES_WEATHER, WEATHER_PROMPT, City,
                                               Client, Target, distribution, expect, json_object, openai_client, poll)


def _chat_args(t: Target, prompt: str, max_tokens: int = 24) -> dict:
    return {"model": t.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}


def openai_chat(t: Target) -> None:
    choice = openai_client(t).chat.completions.create(**_chat_args(t, "Say hello.")).choices[0]
    expect(choice.message.content and choice.finish_reason in ("stop", "length"), f"reply: {choice}")


def openai_stream(t: Target) -> None:
    chunks = list(openai_client(t).chat.completions.create(**_chat_args(t, "Say hello."), stream=True,
                                                             stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expect(text and chunks[-1].usage and chunks[-1].usage.completion_tokens, f"stream: {text!r}, {chunks[-1]}")


def openai_tools_forced(t: Target) -> None:
    reply = openai_client(t).chat.completions.create(**_chat_args(t, WEATHER_PROMPT, 60), tools=[CHAT_WEATHER],
                                                      tool_choice="required", parallel_tool_calls=False)
    calls = reply.choices[0].message.tool_calls or []
    expect(len(calls) == 1 and calls[0].function.name == "get_weather", f"calls: {calls}")
    json_object(calls[0].function.arguments)


def openai_tools_auto(t: Target) -> None:
    message = openai_client(t).chat.completions.create(**_chat_args(t, WEATHER_PROMPT, 60), tools=[CHAT_WEATHER],
                                                        tool_choice="auto").choices[0].message
    for call in message.tool_calls or []:
        json_object(call.function.arguments)
    expect(message.content or message.tool_calls, f"neither text nor a call: {message}")


def openai_structured(t: Target) -> None:
    client = openai_client(t)
    parsed = client.chat.completions.parse(**_chat_args(t, CITY_PROMPT, 60), response_format=City)
    expect(isinstance(parsed.choices[0].message.parsed, City), f"chat parse: {parsed.choices[0].message}")
    reply = client.responses.parse(model=t.model, input=CITY_PROMPT, text_format=City, max_output_tokens=60,
                                   temperature=0)
    expect(isinstance(reply.output_parsed, City), f"responses parse: {reply.output}")


def openai_responses(t: Target) -> None:
    client = openai_client(t)
    reply = client.responses.create(model=t.model, input="Say hello.", max_output_tokens=16, temperature=0)
    expect(reply.output_text, f"reply: {reply}")
    events = list(client.responses.create(model=t.model, input="Say hello.", max_output_tokens=16, temperature=0,
                                          stream=True))
    expect(events[-1].type == "response.completed" or events[-1].type == "response.incomplete",
           f"last event: {events[-1].type}")
    called = client.responses.create(model=t.model, input=WEATHER_PROMPT, tools=[RESPONSES_WEATHER],
                                     tool_choice="required", parallel_tool_calls=False, max_output_tokens=60)
    [call] = [item for item in called.output if item.type == "function_call"]
    json_object(call.arguments)


def openai_stored(t: Target) -> None:
    """Retrieved, chained by ``previous_response_id``, run in the background and polled, deleted."""
    client = openai_client(t)
    first = client.responses.create(model=t.model, input="My name is Ada.", max_output_tokens=8, temperature=0)
    expect(client.responses.retrieve(first.id).output_text == first.output_text, "retrieved text differs")
    second = client.responses.create(model=t.model, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    expect(second.previous_response_id == first.id, f"previous_response_id: {second.previous_response_id}")
    queued = client.responses.create(model=t.model, input="Name a colour.", max_output_tokens=4, background=True)
    done = poll(lambda: client.responses.retrieve(queued.id), lambda r: r.status not in ("queued", "in_progress"))
    expect(done.status in ("completed", "incomplete") and done.output_text, f"background: {done}")
    client.responses.delete(first.id)


def openai_conversations(t: Target) -> None:
    client = openai_client(t)
    conversation = client.conversations.create(items=[{"role": "user", "content": "My name is Ada."}])
    reply = client.responses.create(model=t.model, input="What is my name?", conversation=conversation.id,
                                    max_output_tokens=8, temperature=0)
    items = client.conversations.items.list(conversation.id, order="asc").data
    expect(len(items) == 3 and items[-1].id == reply.output[0].id, f"items: {[i.id for i in items]}")
    expect(client.conversations.delete(conversation.id).deleted, "not deleted")


def openai_files_batches(t: Target) -> None:
    client = openai_client(t)
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": _chat_args(t, "Hi.", 4)}
    upload = client.files.create(file=("batch.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = poll(lambda: client.batches.retrieve(batch.id), lambda b: b.status in ("completed", "failed", "expired",
                                                                                   "cancelled"))
    expect(done.status == "completed" and done.output_file_id, f"batch: {done}")
    [out] = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    expect(out["custom_id"] == "r1" and out["response"]["status_code"] == 200, f"output line: {out}")


CLIENT = Client("openai (Python)", distribution("openai"), {
    "chat": openai_chat, "stream": openai_stream, "tools_forced": openai_tools_forced,
    "tools_auto": openai_tools_auto, "structured": openai_structured, "responses": openai_responses,
    "stored": openai_stored, "conversations": openai_conversations, "files_batches": openai_files_batches})
