"""Typed engine errors; each names the offending field so callers can map it to a 4xx."""

from __future__ import annotations


class EngineError(Exception):
    code = "engine_error"


class InvalidRequestError(EngineError, ValueError):
    code = "invalid_request"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidSamplingParamsError(InvalidRequestError):
    code = "invalid_sampling_params"


class PromptTooLongError(InvalidRequestError):
    code = "prompt_too_long"

    def __init__(self, num_tokens: int, max_tokens: int, what: str) -> None:
        super().__init__(
            f"prompt has {num_tokens} tokens; at most {max_tokens} fit {what}", field="prompt")
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


class EngineDeadError(EngineError):
    code = "engine_dead"
