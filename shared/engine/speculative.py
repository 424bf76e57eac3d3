"""Speculative decoding with drafts from the request's own tokens (prompt lookup, n-gram).

A decoding request whose last ``n`` tokens also occur earlier in its prompt or output is likely to
continue as it did there: editing a text, rewriting code, quoting a document. The ``NgramProposer``
finds the latest earlier occurrence of the longest such suffix and proposes the tokens that
followed it. The scheduler appends those draft tokens to the request's step, the model computes
them in the same forward as the last token (their KV and logits come at the cost of a few more
rows in a matmul that is memory- and overhead-bound at small batches), and the sampler verifies
them (``Sampler.verify``): a greedy request keeps the draft while it equals the argmax, so its
text is exactly what it would be without speculation; a sampled request accepts a draft token
with its probability and otherwise samples from the rest of the distribution, which leaves the
distribution of every token unchanged (speculative sampling with a one-hot proposal).

Speculation is per request and per step:

* only requests whose every token can be verified from the logits alone: no grammar, no
  penalties, no logit bias, no logprobs, no seed (a seeded request's draws must not depend on
  how much of a draft was accepted);
* only while at most ``max_batch`` requests run: beyond that the step is compute-bound and draft
  rows cost real time;
* a request whose drafts are mostly rejected (its acceptance rate, an exponential average, falls
  under ``min_acceptance``) stops speculating for ``pause_steps`` steps, then tries again.

``DraftProposer`` is the seam for other proposers (a draft model, an EAGLE-style head): anything
that returns up to ``k`` likely next tokens for a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from shared.engine.request import Request


@dataclass(frozen=True)
class SpeculativeConfig:
    num_tokens: int = 0  # draft tokens per step; 0: off
    max_batch: int = 4  # speculate only while this many requests or fewer are running
    min_ngram: int = 2
    max_ngram: int = 4
    min_acceptance: float = 0.3  # below this (exponential average) a request pauses speculating
    pause_steps: int = 32

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or self.max_batch < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"speculative decoding: num_tokens ({self.num_tokens}) must be >= 0, max_batch "
                             f"({self.max_batch}) >= 1 and 1 <= min_ngram ({self.min_ngram}) <= max_ngram "
                             f"({self.max_ngram})")

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0


class DraftProposer(Protocol):
    def propose(self, request: Request, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens likely to follow the request's tokens (none: no guess)."""

    def forget(self, request_id: str) -> None:
        """The request is gone: drop what was kept for it."""


@dataclass
class _NgramIndex:
    """Latest start of every n-gram (n in [min, max]) that has at least one token after it."""

    starts: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0  # tokens covered: every n-gram ending before this position is indexed


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's
    longest matching suffix (``max_ngram`` down to ``min_ngram`` tokens). The index of n-grams
    grows with the request, so a step costs O(new tokens), not O(sequence)."""

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        tokens = request.all_token_ids
        index = self._indexes.setdefault(request.request_id, _NgramIndex())
        self._extend(index, tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = index.starts.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n:start + n + num_tokens]
        return []

    def _extend(self, index: _NgramIndex, tokens: list[int]) -> None:
        """Index the n-grams that end before the last token (each has a token after it)."""
        end = len(tokens) - 1
        for stop in range(max(index.num_indexed, self.min_ngram), end + 1):
            for n in range(self.min_ngram, min(self.max_ngram, stop) + 1):
                index.starts[tuple(tokens[stop - n:stop])] = stop - n
        index.num_indexed = max(index.num_indexed, end + 1)

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


def can_speculate(request: Request) -> bool:
    """Whether the sampler can verify drafts for this request from the logits alone."""
    p = request.sampling_params
    return (p.grammar is None and not p.has_penalties and not p.logit_bias and p.logprobs is None
            and p.seed is None)


@dataclass
class _Acceptance:
    rate: float = 1.0  # exponential average of accepted / drafted
    paused_until: int = 0  # step number


@dataclass
class SpeculationStats:
    num_drafted: int = 0
    num_accepted: int = 0
    num_steps: int = 0  # request-steps that carried a draft


class Speculator:
    """Decides each step which running requests carry which draft; learns from the verdicts."""

    def __init__(self, config: SpeculativeConfig, proposer: DraftProposer | None = None) -> None:
        self.config = config
        self.proposer = proposer or NgramProposer(config.min_ngram, config.max_ngram)
        self.stats = SpeculationStats()
        self._acceptance: dict[str, _Acceptance] = {}
        self._step = 0

    def begin_step(self) -> None:
        self._step += 1

    def draft(self, request: Request, num_running: int, max_model_len: int) -> list[int]:
        """The draft for this step of a decoding request (its last token not yet computed)."""
        cfg = self.config
        if not cfg.enabled or num_running > cfg.max_batch or not can_speculate(request):
            return []
        acceptance = self._acceptance.setdefault(request.request_id, _Acceptance())
        if self._step < acceptance.paused_until:
            return []
        # the last step appends the draft it accepted and one more token: no draft past max_tokens
        room = min(request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
                   max_model_len - request.num_tokens - 1, cfg.num_tokens)
        if room <= 0:
            return []
        return self.proposer.propose(request, room)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        self.stats.num_drafted += num_drafted
        self.stats.num_accepted += num_accepted
        self.stats.num_steps += 1
        acceptance = self._acceptance.setdefault(request_id, _Acceptance())
        acceptance.rate = 0.7 * acceptance.rate + 0.3 * (num_accepted / num_drafted)
        if acceptance.rate < self.config.min_acceptance:
            acceptance.paused_until = self._step + self.config.pause_steps
            acceptance.rate = self.config.min_acceptance  # one good draft after the pause resumes it

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
        self.proposer.forget(request_id)
