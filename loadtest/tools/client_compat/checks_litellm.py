"""litellm's ``completion``, ``responses`` and batch functions with an ``openai/`` model and
``api_base``. litellm reads its model cost map from the files it ships (``LITELLM_LOCAL_MODEL_COST_MAP``,
read at import), so nothing is fetched from the internet."""

from __future__ import annotations

import json
import os

from loadtest.tools.client_compat.base import (CHAT_WEATHER, CITY_PROMPT, TIMEOUT_S, WEATHER_PROMPT, City, Client,
                                               Target, distribution, expect, json_object, poll)


def _litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read at import: no fetch from the internet
    import litellm

    litellm.suppress_debug_info = True
    return litellm


def _litellm_args(t: Target, prompt: str, max_tokens: int = 24) -> dict:
    return {"model": f"openai/{t.model}", "api_base": t.v1, "api_key": "unused", "num_retries": 0,
            "timeout": TIMEOUT_S, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}


def litellm_chat(t: Target) -> None:
    reply = _litellm().completion(**_litellm_args(t, "Say hello."))
    expect(reply.choices[0].message.content, f"reply: {reply}")


def litellm_stream(t: Target) -> None:
    litellm = _litellm()
    chunks = list(litellm.completion(**_litellm_args(t, "Say hello."), stream=True,
                                     stream_options={"include_usage": True}))
    built = litellm.stream_chunk_builder(chunks)
    expect(built.choices[0].message.content and built.usage.completion_tokens, f"built: {built}")


def litellm_tools_forced(t: Target) -> None:
    reply = _litellm().completion(**_litellm_args(t, WEATHER_PROMPT, 60), tools=[CHAT_WEATHER],
                                  tool_choice="required", parallel_tool_calls=False)
    calls = reply.choices[0].message.tool_calls or []
    expect(len(calls) == 1 and calls[0].function.name == "get_weather", f"calls: {calls}")
    json_object(calls[0].function.arguments)


def litellm_tools_auto(t: Target) -> None:
    message = _litellm().completion(**_litellm_args(t, WEATHER_PROMPT, 60), tools=[CHAT_WEATHER]).choices[0].message
    for call in message.tool_calls or []:
        json_object(call.function.arguments)
    expect(message.content or message.tool_calls, f"neither text nor a call: {message}")


def litellm_structured(t: Target) -> None:
    reply = _litellm().completion(**_litellm_args(t, CITY_PROMPT, 60), response_format=City)
    City.model_validate_json(reply.choices[0].message.content)


def litellm_responses(t: Target) -> None:
    args = _litellm_args(t, "")
    reply = _litellm().responses(model=args["model"], api_base=t.v1, api_key="unused", input="Say hello.",
                                 max_output_tokens=16, temperature=0, timeout=TIMEOUT_S)
    text = "".join(part.text for item in reply.output if item.type == "message" for part in item.content)
    expect(text, f"reply: {reply}")


def litellm_files_batches(t: Target) -> None:
    litellm = _litellm()
    common = {"custom_llm_provider": "openai", "api_base": t.v1, "api_key": "unused"}
    body = {"model": t.model, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    upload = litellm.create_file(file=("batch.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch", **common)
    batch = litellm.create_batch(completion_window="24h", endpoint="/v1/chat/completions", input_file_id=upload.id,
                                 **common)
    done = poll(lambda: litellm.retrieve_batch(batch.id, **common),
                lambda b: b.status in ("completed", "failed", "expired", "cancelled"))
    expect(done.status == "completed" and done.output_file_id, f"batch: {done}")
    [out] = [json.loads(x) for x in litellm.file_content(done.output_file_id, **common).text.splitlines()]
    expect(out["custom_id"] == "r1" and out["response"]["status_code"] == 200, f"output line: {out}")


CLIENT = Client("litellm", distribution("litellm"), {
    "chat": litellm_chat, "stream": litellm_stream, "tools_forced": litellm_tools_forced,
    "tools_auto": litellm_tools_auto, "structured": litellm_structured, "responses": litellm_responses,
    "files_batches": litellm_files_batches})
