"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``), validated by pydantic.

Which parameters exist at all, and which are refused, is decided first by ``fields.check_fields``
(an unknown one is a 400, as at OpenAI); these models range-check the accepted ones so a bad value
is a 400 naming the parameter, never a 5xx.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Self, Union

from pydantic import (BaseModel, ConfigDict, Field, JsonValue, PrivateAttr, StrictBool, StrictInt, StrictStr,
                      field_validator, model_validator)

from shared.openai_api.errors import ApiError
from shared.openai_api.tool_formats import HERMES, ToolFormat
from shared.openai_api.tools import NamedToolChoice, Tool, ToolCall, ToolChoice, ToolUse, render_calls
from shared.policy.qos import ServiceTierName
from shared.protocol.generate import GrammarSpec

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Closed(BaseModel):
    """An object whose fields are all known: an unknown one is a 400 naming its path (e.g.
    ``response_format.schema``), as an unknown top-level parameter is. (Messages and input items
    stay open: clients send back what they got, with fields such as ``refusal`` or ``annotations``.)"""

    model_config = ConfigDict(extra="forbid")


# content parts of another modality: named in a 400, not left to the union's own error
MEDIA_PARTS = {"image_url": "image", "input_image": "image", "input_audio": "audio", "file": "file",
               "input_file": "file", "audio_url": "audio", "video_url": "video"}


def refuse_media(items: object, param: str) -> None:
    """A 400 naming the first content part of ``items`` (messages or input items) that is not
    text, e.g. ``messages[0].content[1]``."""
    for i, item in enumerate(items if isinstance(items, list) else []):
        content = item.get("content") if isinstance(item, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = MEDIA_PARTS.get(part.get("type")) if isinstance(part, dict) else None
            if kind is not None:
                where = f"{param}[{i}].content[{j}]"
                raise ApiError(400, f"{where}: {kind} inputs are not supported by this server (text models "
                               f"only); send text content parts", param=where, code="unsupported_content")


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: Role
    content: Union[StrictStr, list[TextPart], None] = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls

    def text(self, fmt: ToolFormat = HERMES) -> str:
        """The content as the model sees it; earlier tool calls as the model would write them
        (in ``fmt``)."""
        return self.content_text() + render_calls(self.tool_calls or [], fmt)

    def content_text(self) -> str:
        """The content alone (its text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class JsonSchemaFormat(_Closed):
    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None  # the schema is enforced either way


class ResponseFormat(_Closed):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Closed):
    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None  # accepted; chunks are not padded


MAX_STOP = 4  # stop strings, as OpenAI allows
Stop = Union[StrictStr, Annotated[list[StrictStr], Field(max_length=MAX_STOP)], None]


MAX_CHOICES = 16
MAX_LOGIT_BIAS = 300  # entries, as OpenAI documents
MAX_TOKEN_ID_DIGITS = 9  # a token id in logit_bias: vocabularies are far below 10**9


# the chat template's own variables: chat_template_kwargs may not set them
TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                      "unk_token", "pad_token")
MAX_TEMPLATE_KWARGS = 64


def check_template_kwargs(kwargs: dict | None, param: str = "chat_template_kwargs") -> None:
    """A 400 naming ``param`` when ``chat_template_kwargs`` would set one of the template's own
    variables."""
    taken = sorted(set(kwargs or {}) & set(TEMPLATE_VARIABLES))
    if taken:
        raise ApiError(400, f"{param} may not set the chat template's own variables: {', '.join(taken)}",
                       param=f"{param}.{taken[0]}", code="invalid_value")


MAX_DEADLINE_MS = 7 * 24 * 3600 * 1000  # a week: past that a deadline orders nothing
# the largest token count (max_tokens, top_k) taken: no context comes near it, and engines a text
# worker fronts may hold it in 32 bits (a 4,000-digit max_tokens once went through to the worker)
MAX_TOKEN_COUNT = 2**31 - 1


class _Sampling(_Body):
    model: StrictStr | None = Field(None, min_length=1)  # None: the one model served
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0, le=MAX_TOKEN_COUNT)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: Stop = None
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: StrictStr | None = None
    ignore_eos: StrictBool = False
    guided_regex: StrictStr | None = Field(None, min_length=1)  # extension, as vLLM
    # extension: finish within this many ms of arrival (also the x-tandem-deadline-ms header)
    deadline_ms: float | None = Field(None, gt=0, le=MAX_DEADLINE_MS)
    # OpenAI's processing tier, mapped onto a QoS tier (shared.policy.qos.serve_tier); None: as "auto"
    service_tier: ServiceTierName | None = None

    def grammar(self) -> tuple[GrammarSpec, str] | None:
        """What the output must match, and the parameter that asked for it."""
        if self.guided_regex is not None:
            return GrammarSpec(kind="regex", value=self.guided_regex), "guided_regex"
        return None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_and_range(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            # isascii: str.isdigit() admits "²" and other digits int() refuses; the length bound keeps
            # int() off a 5,000-digit key (it refuses those too). The vocabulary bound is checked
            # against the tokenizer later (check_logit_bias).
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
                raise ValueError(f"keys must be token ids (up to {MAX_TOKEN_ID_DIGITS} decimal digits), "
                                 f"got {key[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return v

    def token_biases(self) -> dict[int, float] | None:
        return {int(k): b for k, b in self.logit_bias.items()} if self.logit_bias else None

    def check_combinations(self) -> None:
        """A 400 for parameters that are each valid but not together."""

    def num_choices(self) -> int:
        """Generations to run (``best_of`` on completions may run more than it returns)."""
        return self.n

    @field_validator("stop", mode="before")
    @classmethod
    def _at_most_max_stop(cls, v: object) -> object:
        # before the union: its own error for a long list is "stop.str: Input should be a valid string"
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(v)}")
        return v

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: Stop) -> Stop:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class _ToolRequest(_Sampling):
    """A request that may call tools (chat and Responses): the gateway sets the model's tool-call
    format on it (``with_tool_format``) before ``tool_use`` reads it."""

    _tool_format: ToolFormat = PrivateAttr(default_factory=lambda: HERMES)  # the gateway's (``with_tool_format``)
    _special_markers: tuple[str, ...] = PrivateAttr(default=())  # ``ToolUse.special_markers``

    def tool_use(self) -> ToolUse:
        """The request's tools and tool choice with the tool-call format set on it."""
        raise NotImplementedError

    def with_tool_format(self, fmt: ToolFormat, special_markers: tuple[str, ...] = ()) -> Self:
        """This request with the model's tool-call format (``shared.openai_api.tool_formats``) and
        those of its markers that are special tokens of the model's tokenizer."""
        copy = self.model_copy()
        copy._tool_format, copy._special_markers = fmt, special_markers
        return copy

    def tool_mode(self) -> Literal["none", "auto", "forced"]:
        """none: answer in text; auto: the model may call; forced: it must (a grammar sees to it)."""
        return self.tool_use().mode


class ChatCompletionRequest(_ToolRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKEN_COUNT)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKEN_COUNT)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    # accepted and ignored (fields.py), but a value OpenAI would refuse is a 400 here too
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # extension, as vLLM: extra variables of the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, JsonValue] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: object) -> object:
        if isinstance(data, dict):
            refuse_media(data.get("messages"), "messages")
        return data

    def check_combinations(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.guided_regex is not None:
            raise ApiError(400, "give response_format or guided_regex, not both", param="guided_regex")
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
            raise ApiError(400, "response_format.json_schema is required for type json_schema",
                           param="response_format.json_schema")
        check_template_kwargs(self.chat_template_kwargs)
        self._check_tools()

    def _check_tools(self) -> None:
        choice, names = self.tool_choice, [t.function.name for t in self.tools or []]
        if choice not in (None, "none", "auto") and not names:
            raise ApiError(400, "tool_choice requires tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ApiError(400, f"tool_choice names {choice.function.name!r}, not one of the tools {names}",
                           param="tool_choice")
        if self.tool_mode() == "forced" and (self.grammar_of_format() or self.guided_regex):
            raise ApiError(400, "a forced tool call cannot also have a response_format or guided_regex",
                           param="tool_choice")

    def tool_use(self) -> ToolUse:
        return ToolUse(self.tools or [], self.tool_choice, self.parallel_tool_calls is not False, self._tool_format,
                       self._special_markers)

    def grammar(self) -> tuple[GrammarSpec, str] | None:
        """A forced call's grammar; else the format's (or ``guided_regex``); else, under ``auto``
        with a ``strict`` function, text or valid calls."""
        tools = self.tool_use().grammar()
        if self.tool_mode() == "forced":
            return tools, "tools"
        asked = self.grammar_of_format() or super().grammar()
        return asked or ((tools, "tools") if tools is not None else None)

    def grammar_of_format(self) -> tuple[GrammarSpec, str] | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return GrammarSpec(kind="json_object"), "response_format"
        return GrammarSpec(kind="json_schema", value=json.dumps(fmt.json_schema.schema_)), "response_format"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, Annotated[list[StrictInt], Field(min_length=1)],
                  Annotated[list[StrictStr], Field(min_length=1, max_length=1)]]
    max_tokens: StrictInt | None = Field(16, ge=1, le=MAX_TOKEN_COUNT)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_CHOICES)

    def check_combinations(self) -> None:
        """A 400 for parameters that are each valid but not together."""
        if self.best_of is not None and self.best_of < self.n:
            raise ApiError(400, f"best_of must be at least n ({self.n}), got {self.best_of}", param="best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ApiError(400, "best_of > n cannot be streamed", param="best_of")
        if self.echo and self.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported: prompt logprobs are not computed",
                           param="echo")

    def num_choices(self) -> int:
        return self.best_of or self.n

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs


# The body of either endpoint; both answer requested_max_tokens() and num_logprobs().
ApiRequest = Union[ChatCompletionRequest, CompletionRequest]
