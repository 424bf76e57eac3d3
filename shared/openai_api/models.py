"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``), validated by pydantic.

Unknown parameters are ignored (as vLLM does) so clients sending newer fields keep working; known
ones are range-checked so a bad value is a 400 naming the parameter, never a 5xx.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: Role
    content: Union[StrictStr, list[TextPart], None] = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: StrictBool = False


Stop = Union[StrictStr, Annotated[list[StrictStr], Field(max_length=4)], None]


class _Sampling(_Body):
    model: StrictStr = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: Stop = None
    n: StrictInt = Field(1, ge=1, le=1, description="only n=1 is supported")
    user: StrictStr | None = None
    ignore_eos: StrictBool = False

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


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, Annotated[list[StrictInt], Field(min_length=1)],
                  Annotated[list[StrictStr], Field(min_length=1, max_length=1)]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs


# The body of either endpoint; both answer requested_max_tokens() and num_logprobs().
ApiRequest = Union[ChatCompletionRequest, CompletionRequest]
