"""Request state and sampling parameters: plain Python, no tensors."""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field

from shared.engine.errors import InvalidSamplingParamsError
from shared.grammar.spec import GrammarSpec
from shared.kvcache.hashing import hash_blocks

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each token
    logit_bias: dict[int, float] | None = None  # token id → added to its logit; -100 bans it
    grammar: GrammarSpec | None = None  # the output must match it (structured outputs)
    # the last n prompt tokens are output of an earlier run of this request (it moved here from
    # another worker): the grammar state is replayed over them
    num_output_in_prompt: int = 0
    # how its decode rows ran on the worker it moved from ("eager" or "compiled"): they run so here
    # too where this worker can (Request.decode_path), so its tokens keep their numerical path
    decode_path: str | None = None

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidSamplingParamsError naming the first bad field."""
        def bad(name: str, why: str) -> None:
            raise InvalidSamplingParamsError(f"{name} {why}, got {getattr(self, name)!r}", field=name)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be a positive integer")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "must be in [0, 100]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be 0 (off) or a positive integer")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", "must be in (0, 10]")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            bad("seed", "must be a non-negative 64-bit integer")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.logit_bias and any(not 0 <= t < vocab_size or not -100.0 <= b <= 100.0
                                   for t, b in self.logit_bias.items()):
            bad("logit_bias", f"must map token ids in [0, {vocab_size}) to biases in [-100, 100]")
        if not 0 <= self.num_output_in_prompt:
            bad("num_output_in_prompt", "must not be negative")
        if self.decode_path not in (None, "eager", "compiled"):
            bad("decode_path", "must be 'eager', 'compiled' or not given")
        if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks reserved; a prefill worker writes them
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KV)


_arrival_counter = itertools.count()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs first
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[int] = field(default_factory=list)
    keep_kv: bool = False  # when finished, hold the blocks until released (a transfer reads them)
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    first_scheduled_time: float | None = None  # time.monotonic() of the step that first ran it
    deadline: float = math.inf  # when it should be finished (Unix seconds): earlier first within a priority
    # "compiled" or "eager": how its decode rows run, fixed at the first one (shared/engine/model_runner.py)
    decode_path: str | None = None
    suspended: bool = False  # its rows are in a step stopped between two layers (ModelRunner.suspended)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def grammar_token_ids(self) -> list[int]:
        """What the request has generated under its grammar, here and before a move."""
        num_replayed = self.sampling_params.num_output_in_prompt
        replayed = self.prompt_token_ids[len(self.prompt_token_ids) - num_replayed:] if num_replayed else []
        return replayed + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prefill_end(self) -> int:
        """Positions before this one may be computed many per step (prefill chunks); the others one
        per step, as decode rows. For a greedy request that is its own prompt's end also when it
        recomputes tokens it generated (after a move from another worker: the prompt's last
        ``num_output_in_prompt`` tokens; after a preemption: its output): decode rows and prefill
        chunks differ in the last bits of attention, which int8 rounding can carry into a token, so
        recomputing them as they were first computed keeps its continuation the same. Others (and a
        request that moved here with a different sampler state anyway) prefill all they can."""
        if self.sampling_params.temperature != 0.0:
            return self.num_tokens
        return self.num_prompt_tokens - self.sampling_params.num_output_in_prompt

    @property
    def num_reusable_tokens(self) -> int:
        """How far its KV may come from elsewhere (the prefix cache, a prefix lookup): up to
        ``prefill_end``, with one more token for the cache's rule that the last one is computed."""
        return min(self.num_tokens, self.prefill_end + 1)

    def decodes_at(self, position: int) -> bool:
        """Whether computing position ``position`` alone is a decode row: an output token, generated
        now or recomputed (``prefill_end``)."""
        return position >= min(self.prefill_end, self.num_prompt_tokens)

    def chunk(self, start: int, budget: int) -> int:
        """How many tokens from position ``start`` to compute this step, at most ``budget``."""
        end = self.prefill_end
        if start >= end:
            return min(1, budget, self.num_tokens - start)
        return min(self.num_tokens - start, budget, end - start)

    @property
    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.deadline, self.arrival_seq)

    def update_block_hashes(self, block_size: int, namespace: bytes) -> None:
        """Extend the chained hashes over newly completed full blocks."""
        start = len(self.block_hashes)
        if (start + 1) * block_size > self.num_tokens:
            return
        parent = self.block_hashes[-1] if self.block_hashes else 0
        self.block_hashes.extend(hash_blocks(
            self.all_token_ids, block_size, namespace, parent_hash=parent, start_block=start))

    def append_token(self, token_id: int, max_model_len: int) -> None:
        """Record a sampled token and decide whether the request is done."""
        self.output_token_ids.append(token_id)
        params = self.sampling_params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            self.status = RequestStatus.FINISHED_STOPPED
        elif len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
