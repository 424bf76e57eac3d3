"""Every request parameter of ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``
and what Tandem does with it: implemented, accepted and ignored (it has no meaning here), or refused with a 400 naming
it. A parameter no table lists is refused too ("Unrecognized request argument", as OpenAI does), so
nothing a client sends is silently dropped. docs/api.md's table is ``markdown_table()``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.openai_api.errors import ApiError


class Status(enum.Enum):
    IMPLEMENTED = "implemented"
    IGNORED = "accepted, ignored"
    REFUSED = "400"
    EXTENSION = "extension"


@dataclass(frozen=True)
class FieldRule:
    status: Status
    note: str = ""
    # REFUSED fields: values that mean "off" and are accepted anyway (e.g. ``modalities: ["text"]``)
    accepts: Callable[[Any], bool] = lambda value: value is None


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in values


I, X, R, E = Status.IMPLEMENTED, Status.IGNORED, Status.REFUSED, Status.EXTENSION

_COMMON: dict[str, FieldRule] = {
    "model": FieldRule(I, "may be omitted when one model is served"),
    "stream": FieldRule(I),
    "stream_options": FieldRule(I, "`include_usage`"),
    "temperature": FieldRule(I),
    "top_p": FieldRule(I),
    "presence_penalty": FieldRule(I),
    "frequency_penalty": FieldRule(I),
    "seed": FieldRule(I, "per-request generator; choice i of `n` uses seed + i"),
    "stop": FieldRule(I, "up to 4 strings"),
    "n": FieldRule(I, "up to 16; the choices share the prompt's KV blocks (prefix cache)"),
    "logit_bias": FieldRule(I, "token id (decimal, up to 9 digits, in the vocabulary) → bias in [-100, 100]; -100 bans the token"),
    "max_tokens": FieldRule(I),
    "user": FieldRule(X, "no per-user accounting here"),
    "top_k": FieldRule(E, "as vLLM"),
    "min_p": FieldRule(E, "as vLLM"),
    "repetition_penalty": FieldRule(E, "as vLLM"),
    "ignore_eos": FieldRule(E, "as vLLM"),
    "guided_regex": FieldRule(E, "as vLLM: the output matches the regex"),
    "deadline_ms": FieldRule(E, "finish within this many ms of arrival (or the `x-tandem-deadline-ms` header): "
                                "earliest deadline first within the tier; 429 `deadline` when predicted later"),
    "service_tier": FieldRule(I, "`auto`, `default`, `flex`, `priority` → a QoS tier (`service_tiers` of the QoS "
                                 "file), never above the API key's; echoed as served; `flex` waits out 429s for "
                                 "load up to `--flex-max-wait-s` (see Service tiers below)"),
}

CHAT_FIELDS: dict[str, FieldRule] = {
    **_COMMON,
    "messages": FieldRule(I, "text content parts only; `tool` role accepted"),
    "max_completion_tokens": FieldRule(I),
    "logprobs": FieldRule(I),
    "top_logprobs": FieldRule(I, "up to 20"),
    "response_format": FieldRule(I, "`text`, `json_object` (no key twice), `json_schema` (enforced token by "
                                 "token, `strict` or not); a schema feature not implemented is a 400 naming it"),
    "tools": FieldRule(I, "functions; in the chat template when it renders tools, else a system message; "
                          "arguments follow the schema by grammar (forced, or `strict` under `auto`), where "
                          "properties it does not name are not allowed unless it sets `additionalProperties`"),
    "tool_choice": FieldRule(I, "`none`, `auto`, `required`, a named function (the last two by grammar); "
                                "cut off by the token limit: the calls written whole, finish `length` "
                                "(see Tool calls below)"),
    "parallel_tool_calls": FieldRule(I, "false: at most one call; true: distinct calls, at most 8 under a "
                                        "forced choice"),
    "chat_template_kwargs": FieldRule(E, "as vLLM: an object of extra chat template variables (e.g. "
                                         "`{\"enable_thinking\": false}` for Qwen3); not `messages`, `tools`, "
                                         "`add_generation_prompt` or the special tokens"),
    "functions": FieldRule(R, "deprecated; use `tools`", accepts=lambda v: not v),
    "function_call": FieldRule(R, "deprecated; use `tool_choice`", accepts=_one_of("none")),
    "modalities": FieldRule(R, "text only", accepts=lambda v: v is None or v == ["text"]),
    "audio": FieldRule(R, "no audio output"),
    "prediction": FieldRule(R, "no predicted outputs"),
    "web_search_options": FieldRule(R, "no web search"),
    # agent frameworks send these to any model: accepted where they change nothing
    "reasoning_effort": FieldRule(X, "no effort control: a thinking model reasons as it does (its reasoning "
                                     "comes back in `reasoning_content`)"),
    "verbosity": FieldRule(X, "no verbosity control: the length of the text does not change"),
    "moderation": FieldRule(R, "no moderation"),
    "store": FieldRule(R, "chat completions are not stored", accepts=_one_of(False)),
    "metadata": FieldRule(X, "chat: only stored completions use it, and none are"),
    "prompt_cache_key": FieldRule(X, "prefix caching is automatic"),
    "prompt_cache_retention": FieldRule(X, "prefix caching is automatic"),
    "prompt_cache_options": FieldRule(X, "prefix caching is automatic"),
    "safety_identifier": FieldRule(X, "no per-user accounting here"),
}

COMPLETION_FIELDS: dict[str, FieldRule] = {
    **_COMMON,
    "prompt": FieldRule(I, "a string, one-string list, or token ids; batches of prompts refused"),
    "logprobs": FieldRule(I, "up to 20"),
    "echo": FieldRule(I, "not together with `logprobs` (no prompt logprobs)"),
    "best_of": FieldRule(I, "up to 16, ≥ `n`; the `n` with the highest mean token logprob; not streamed"),
    "suffix": FieldRule(R, "no insertion mode"),
}


RESPONSES_FIELDS: dict[str, FieldRule] = {
    **{k: _COMMON[k] for k in ("model", "stream", "temperature", "top_p", "user", "top_k", "min_p",
                               "ignore_eos", "guided_regex", "deadline_ms", "service_tier")},
    "input": FieldRule(I, "a string, or items: text messages, `function_call`, `function_call_output`"),
    "instructions": FieldRule(I, "a system message before the input"),
    "max_output_tokens": FieldRule(I),
    "text": FieldRule(I, "`format`: text, json_object, json_schema; `verbosity`: accepted and echoed in "
                         "`response.text.verbosity`, the text does not change"),
    "metadata": FieldRule(I, "responses: up to 16 string pairs, kept with the stored response"),
    "safety_identifier": FieldRule(X, "no per-user accounting here"),
    "prompt_cache_key": FieldRule(X, "prefix caching is automatic"),
    "prompt_cache_retention": FieldRule(X, "prefix caching is automatic"),
    "prompt_cache_options": FieldRule(X, "prefix caching is automatic"),
    "truncation": FieldRule(R, "only `disabled`", accepts=_one_of("disabled")),
    "store": FieldRule(I, "responses: default true; the response and its input items are kept in NATS for "
                          "`TANDEM_RESPONSES_TTL_S` (default 30 days), readable from any gateway"),
    "previous_response_id": FieldRule(I, "the stored conversation (each earlier turn's input and output "
                                         "items, not its `instructions`) comes before `input`; another API "
                                         "key's response is a 404"),
    "conversation": FieldRule(I, "a conversation id or `{\"id\": ...}`: its items come before `input`, and this "
                                 "request's input and output items are added to it once the response is made "
                                 "(`/v1/conversations`); not with `previous_response_id`; another API key's "
                                 "conversation is a 404"),
    "background": FieldRule(I, "requires `store`; not with `stream`; poll `GET /v1/responses/{id}`; "
                               "admission's 429s are waited out (Retry-After) for up to "
                               "`TANDEM_BACKGROUND_RETRY_MAX_WAIT_S` (default 10 min)"),
    "tools": FieldRule(I, "functions only (as chat completions)"),
    "tool_choice": FieldRule(I, "as chat completions"),
    "parallel_tool_calls": FieldRule(I, "as chat completions"),
    "max_tool_calls": FieldRule(X, "limits built-in tools; there are none"),
    "include": FieldRule(R, "nothing extra to include", accepts=lambda v: not v),
    "top_logprobs": FieldRule(R, "no logprobs on this endpoint yet", accepts=_one_of(0)),
    "stream_options": FieldRule(X, "`include_obfuscation`: events are not padded"),
    "reasoning": FieldRule(I, "`effort` is accepted and echoed in `response.reasoning.effort` (no effort control: "
                              "nothing changes); `summary` refused, no summaries are made (a thinking model's "
                              "reasoning comes back whole, in a `reasoning` item)"),
    **{name: FieldRule(R, why) for name, why in (
        ("background_options", "no background options"),
        ("prompt", "no stored prompts"), ("context_management", "no context management"),
        ("moderation", "no moderation"), ("image", "text only"), ("access_programs", "not supported"))},
}



def check_fields(data: Mapping[str, Any], rules: Mapping[str, FieldRule]) -> None:
    """A 400 naming the first parameter that is unknown or refused with a value other than off."""
    for name, value in data.items():
        rule = rules.get(name)
        if rule is None:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name,
                           code="unrecognized_parameter")
        if rule.status is Status.REFUSED and not rule.accepts(value):
            raise ApiError(400, f"{name} is not supported: {rule.note}", param=name,
                           code="unsupported_parameter")


def markdown_table() -> str:
    """docs/api.md's table: every parameter of the three endpoints with its status."""
    tables = (CHAT_FIELDS, COMPLETION_FIELDS, RESPONSES_FIELDS)
    names = list(dict.fromkeys(name for table in tables for name in table))
    rows = ["| parameter | chat | completions | responses | notes |", "|---|---|---|---|---|"]
    for name in names:
        rules = [table.get(name) for table in tables]
        notes = "; ".join(dict.fromkeys(r.note for r in rules if r and r.note))
        cells = " | ".join(r.status.value if r else "—" for r in rules)
        rows.append(f"| `{name}` | {cells} | {notes} |")
    return "\n".join(rows)
