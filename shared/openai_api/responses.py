"""OpenAI response bodies (chat and text completions, streamed chunks, usage, logprobs) and their
server-sent-event framing."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from shared.protocol.generate import TokenLogprob

TokenText = Callable[[int], str]

SSE_DONE = b"data: [DONE]\n\n"  # the stream's last event, after the finish and usage chunks


def sse_event(payload: dict, *, named: bool = False) -> bytes:
    """One server-sent event. ``named``: an ``event:`` line with the payload's ``type`` first, as
    OpenAI sends the Responses API's events (chat and text completion chunks have none)."""
    data = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    kind = payload.get("type") if named else None
    return data if not isinstance(kind, str) else f"event: {kind}\n".encode() + data


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


def _entry(token_id: int, logprob: float, text: TokenText) -> dict:
    token = text(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict:
    return {"content": [{**_entry(e.token_id, e.logprob, text),
                         "top_logprobs": [_entry(t.token_id, t.logprob, text) for t in e.top]}
                        for e in entries]}


def completion_logprobs(entries: Sequence[TokenLogprob], text: TokenText, offset: int) -> dict:
    tokens, offsets = [], []
    for e in entries:
        tokens.append(text(e.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t.token_id): t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}


def tier_field(service_tier: str | None) -> dict:
    """The ``service_tier`` a response and each of its chunks echo: only when the request asked
    for one (OpenAI: "when the service_tier parameter is set, the response body will include
    the service_tier value based on the processing mode actually used")."""
    return {} if service_tier is None else {"service_tier": service_tier}


def chat_chunk(request_id: str, created: int, model: str, index: int, delta: dict, *,
               finish_reason: str | None = None, logprobs: dict | None = None,
               service_tier: str | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            **tier_field(service_tier),
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def completion_chunk(request_id: str, created: int, model: str, index: int, text: str, *,
                     finish_reason: str | None = None, logprobs: dict | None = None,
                     service_tier: str | None = None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            **tier_field(service_tier),
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def usage_chunk(request_id: str, created: int, model: str, object_name: str, usage_body: dict,
                service_tier: str | None = None) -> dict:
    return {"id": request_id, "object": object_name, "created": created, "model": model,
            **tier_field(service_tier),
            "choices": [], "usage": usage_body}


def chat_choice(index: int, text: str, finish_reason: str, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason}


def completion_choice(index: int, text: str, finish_reason: str, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def envelope(request_id: str, created: int, model: str, object_name: str, choices: list[dict],
             usage_body: dict, service_tier: str | None = None) -> dict:
    return {"id": request_id, "object": object_name, "created": created, "model": model,
            **tier_field(service_tier),
            "choices": choices, "usage": usage_body}


def page(objects: list[dict], *, limit: int, after: str | None) -> dict:
    """A list endpoint's page: ``objects`` in the listing's order, starting after the id ``after``."""
    if after is not None:
        ids = [o["id"] for o in objects]
        objects = objects[ids.index(after) + 1:] if after in ids else []
    shown = objects[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(objects) > limit}
