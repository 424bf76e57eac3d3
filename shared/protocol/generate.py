"""Generation: gateway → admission → decode worker, and the token stream back."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shared.protocol.base import BlockHash, RequestId, WireModel, WorkerId
from shared.protocol.prefill import KvSource

FinishReason = Literal["stop", "length", "abort"]
# a worker's numerical path for a request's decode rows: its eager step or its compiled one
DecodePath = Literal["eager", "compiled"]


class GrammarSpec(WireModel):
    """Structured output: ``value`` is the JSON schema as JSON text (``json_schema``), the regex
    (``regex``), a grammar in llguidance's Lark syntax (``lark``), or empty (``json_object``)."""

    kind: Literal["json_schema", "json_object", "regex", "lark"]
    value: str = ""


class SamplingParams(WireModel):
    """Mirrors the engine's sampling parameters; ranges are checked again by the engine."""

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop_token_ids: list[int] = Field(default_factory=list)
    # filled by the gateway from the tokenizer that made the prompt's ids (the engine's own stop set)
    eos_token_ids: list[int] = Field(default_factory=list, description=(
        "The model's end-of-sequence token ids: a token worker ends the request with finish_reason 'stop' "
        "after generating one of them, unless ignore_eos. Empty: not given (a text request, an older "
        "sender): the worker uses what it knows of its model."))
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    logit_bias: dict[int, float] | None = None  # token id → added to its logit; -100 bans it
    grammar: GrammarSpec | None = None
    # the last n prompt tokens were generated for this request by an earlier worker (the gateway
    # moved it): the worker replays the grammar state over them
    num_output_in_prompt: int = Field(0, ge=0)
    # how the earlier worker ran its decode rows (TokenChunk.decode_path): the new one runs them the
    # same way where it can, so that a greedy request's tokens do not depend on the move
    decode_path: DecodePath | None = None


class TextMessage(WireModel):
    role: str
    content: str


class GenerateRequest(WireModel):
    """One request, tokenized and hashed by the gateway.

    ``block_hashes`` are the chained hashes of the prompt's full blocks (``hash_blocks`` with the
    worker's block size and namespace); admission uses them for the prefix-overlap lookup.

    A request for a text worker (``WorkerInfo.takes_text``) carries no token ids and no hashes:
    ``messages`` (chat) or ``prompt_text`` (completions) instead, for the worker's own tokenizer.
    """

    request_id: RequestId
    model: str
    prompt_token_ids: list[int] = Field(default_factory=list)
    prompt_text: str | None = None
    messages: list[TextMessage] | None = None
    sampling: SamplingParams = SamplingParams()
    block_hashes: list[BlockHash] = Field(default_factory=list)
    priority: int = 0
    tier: str = "default"
    created_at: float = 0.0
    # when the response should be finished (Unix seconds; the client's ``x-tandem-deadline-ms``):
    # within a priority, earlier deadlines are scheduled first; admission rejects what it predicts
    # will finish later
    deadline_at: float | None = None
    # workers that broke the protocol on this request (a malformed chunk, an early end, silence):
    # admission chooses none of them when the gateway asks again
    exclude_workers: list[WorkerId] = Field(default_factory=list)
    # from admission's decision: a worker that holds more of the prompt's prefix than this one; it
    # may fetch those blocks from it (``KvFetchRequest``) or ignore the hint and recompute
    kv_source: KvSource | None = None
    # the sender's instance (``Subjects.origin_alive``): a worker that finds nobody answering
    # there any more aborts the sender's requests instead of generating into a dead inbox
    origin: WorkerId | None = None

    @model_validator(mode="after")
    def _has_a_prompt(self) -> "GenerateRequest":
        if not self.prompt_token_ids and self.prompt_text is None and self.messages is None:
            raise ValueError("prompt_token_ids must not be empty (a text worker's request gives prompt_text "
                             "or messages instead)")
        return self

    @property
    def is_text(self) -> bool:
        """For a text worker: text in, text out."""
        return not self.prompt_token_ids


class TopLogprob(WireModel):
    token_id: int
    logprob: float


class TokenLogprob(WireModel):
    """The sampled token's log-probability and the ``n`` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


class TokenChunk(WireModel):
    """One step of a request's output stream. ``index`` counts chunks from 0 so a consumer sees gaps;
    the last chunk of a stream has ``finish_reason`` set."""

    request_id: RequestId
    index: int = Field(ge=0)
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = Field(0, ge=0)
    num_cached_tokens: int = Field(0, ge=0)
    worker_id: WorkerId | None = None
    # a text worker's output (token_ids then may be empty: usage counts one token per such chunk)
    text: str | None = None
    # first chunk only: the worker's part of the time to first token, phase name → seconds, a
    # partition of its time from receiving the request to this chunk (shared.telemetry.phases)
    phases: dict[str, float] | None = None
    # how the worker runs this request's decode rows, from its first decode row on (a token worker
    # with several numerical paths: Tandem's CPU worker before and after its compile); the gateway
    # passes it on when it moves the request (SamplingParams.decode_path)
    decode_path: DecodePath | None = None


class OriginPing(WireModel):
    """A worker asks a request's ``origin`` whether it is still there (request/reply); no
    responders means it is gone."""

    worker_id: WorkerId
    num_requests: int = Field(0, ge=0)  # how many of its requests the worker is running


class OriginAlive(WireModel):
    origin: WorkerId


class CancelRequest(WireModel):
    """Published (no reply) to a worker's cancel subject when the client went away."""

    request_id: RequestId
    reason: str = "client disconnected"
