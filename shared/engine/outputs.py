"""What a step hands back per request (``EngineOutput``), built from the request's state."""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.request import Request
from shared.engine.sampler import SampledToken


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class EngineOutput:
    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    first_scheduled_time: float | None = None  # the request's (time.monotonic()), for its TTFT phases
    decode_path: str | None = None  # how its decode rows run: "eager" or "compiled" (None before the first)


def make_output(request: Request, new_ids: list[int], token: SampledToken | None = None) -> EngineOutput:
    """The request's output now: ``new_ids`` generated this step; logprobs from ``token`` if any."""
    logprobs = None
    if token is not None and token.logprob is not None:
        logprobs = [TokenLogprobs(token.token_id, token.logprob, token.top_logprobs or ())]
    finish = request.status.value if request.status.is_finished else None
    return EngineOutput(request.request_id, new_ids, logprobs, finish, request.num_prompt_tokens,
                        request.num_cached_tokens, len(request.output_token_ids), request.first_scheduled_time,
                        request.decode_path)
