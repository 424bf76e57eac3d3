"""One adapter per OpenAI endpoint. What differs between ``/v1/chat/completions`` and
``/v1/completions`` lives here: the body type, how the prompt becomes token ids, the request id's
prefix, and the shape of the response and of streamed chunks. The gateway's handlers are written
once against ``ApiAdapter``.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Generic, Self, TypeVar

from pydantic import ValidationError

from shared.openai_api import responses
from shared.openai_api.errors import ApiError, from_validation_error
from shared.openai_api.models import ApiRequest, ChatCompletionRequest, CompletionRequest
from shared.protocol.generate import TokenLogprob
from shared.tokenizer import Tokenizer

Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest)


@dataclass
class Delta:
    """Newly completed text of one request; the last one has ``finish_reason``."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(frozen=True)
class ResponseHead:
    """What every response and chunk of one request repeats."""

    request_id: str
    created: int
    model: str


def parse_body(raw: bytes, body_type: type[Body]) -> Body:
    """The validated request body; a 400 ``ApiError`` naming the problem otherwise."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return body_type.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


class ApiAdapter(ABC, Generic[Body]):
    """One request to one endpoint: its validated ``body`` and the tokenizer that reads and
    writes its text."""

    body_type: ClassVar[type[ApiRequest]]
    id_prefix: ClassVar[str]      # request ids are "<prefix>-<hex>", as OpenAI's
    prompt_param: ClassVar[str]   # the parameter a too-long prompt is reported on
    chunk_object: ClassVar[str]   # "object" of streamed chunks, the usage chunk included

    def __init__(self, body: Body, tokenizer: Tokenizer) -> None:
        self.body = body
        self.tokenizer = tokenizer

    @classmethod
    def from_json(cls, raw: bytes, tokenizer: Tokenizer) -> Self:
        return cls(parse_body(raw, cls.body_type), tokenizer)

    @abstractmethod
    def prompt_ids(self) -> list[int]:
        """The prompt as token ids; a 400 ``ApiError`` when it cannot be one."""

    def opening_chunks(self, head: ResponseHead) -> list[dict]:
        """Chunks streamed before the first token."""
        return []

    @abstractmethod
    def chunk(self, head: ResponseHead, delta: Delta, offset: int) -> dict:
        """The streamed chunk of ``delta``; ``offset``: characters of text streamed before it."""

    @abstractmethod
    def response(self, head: ResponseHead, text: str, finish_reason: str,
                 entries: Sequence[TokenLogprob], usage: dict) -> dict:
        """The whole (non-streamed) response."""

    def usage_chunk(self, head: ResponseHead, usage: dict) -> dict:
        return responses.usage_chunk(head.request_id, head.created, head.model, self.chunk_object, usage)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class ChatAdapter(ApiAdapter[ChatCompletionRequest]):
    body_type = ChatCompletionRequest
    id_prefix = "chatcmpl"
    prompt_param = "messages"
    chunk_object = "chat.completion.chunk"

    def prompt_ids(self) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in self.body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return self.tokenizer.encode(text)

    def opening_chunks(self, head: ResponseHead) -> list[dict]:
        return [responses.chat_chunk(head.request_id, head.created, head.model,
                                     {"role": "assistant", "content": ""})]

    def chunk(self, head: ResponseHead, delta: Delta, offset: int) -> dict:
        logprobs = self._logprobs(delta.logprobs) if delta.logprobs else None
        content = {"content": delta.text} if delta.text else {}
        return responses.chat_chunk(head.request_id, head.created, head.model, content,
                                    finish_reason=delta.finish_reason, logprobs=logprobs)

    def response(self, head: ResponseHead, text: str, finish_reason: str,
                 entries: Sequence[TokenLogprob], usage: dict) -> dict:
        return responses.chat_completion(head.request_id, head.created, head.model, text, finish_reason,
                                         self._logprobs(entries), usage)

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict | None:
        return responses.chat_logprobs(entries, self.token_text) if self.body.logprobs else None


class CompletionAdapter(ApiAdapter[CompletionRequest]):
    body_type = CompletionRequest
    id_prefix = "cmpl"
    prompt_param = "prompt"
    chunk_object = "text_completion"

    def prompt_ids(self) -> list[int]:
        prompt = self.body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            vocab = self.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(prompt)
        ids = self.tokenizer.encode(prompt[0] if isinstance(prompt, list) else prompt)
        if not ids:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return ids

    def chunk(self, head: ResponseHead, delta: Delta, offset: int) -> dict:
        logprobs = self._logprobs(delta.logprobs, offset) if delta.logprobs else None
        return responses.completion_chunk(head.request_id, head.created, head.model, delta.text,
                                          finish_reason=delta.finish_reason, logprobs=logprobs)

    def response(self, head: ResponseHead, text: str, finish_reason: str,
                 entries: Sequence[TokenLogprob], usage: dict) -> dict:
        return responses.completion(head.request_id, head.created, head.model, text, finish_reason,
                                    self._logprobs(entries, 0), usage)

    def _logprobs(self, entries: Sequence[TokenLogprob], offset: int) -> dict | None:
        if self.body.logprobs is None:
            return None
        return responses.completion_logprobs(entries, self.token_text, offset)
