"""Conditional disaggregation: prefill on the decode worker, or send to the global prefill queue.

Short uncached prompts are cheaper to prefill locally than to ship; long ones go remote unless
the prefill queue is already long (then waiting for it would cost more than interfering with the
local decode batch). The same rule as vLLM's / Dynamo's disaggregated router.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DisaggConfig:
    max_local_prefill_tokens: int = 512   # uncached prompts up to this length prefill locally
    max_prefill_queue: int = 128          # beyond this many queued remote prefills, stay local


@dataclass(frozen=True)
class DisaggInput:
    now_s: float
    prompt_tokens: int
    cached_tokens: int            # leading tokens already in this decode worker's KV cache
    prefill_queue_len: int | None  # remote prefill requests waiting (JetStream pending count); None: unknown
    has_prefill_workers: bool = True
    block_size: int = 1           # KV moves in whole blocks: the partial tail is always computed locally


@dataclass(frozen=True)
class DisaggDecision:
    remote: bool
    uncached_tokens: int
    reason: str


def decide_prefill(inp: DisaggInput, cfg: DisaggConfig = DisaggConfig()) -> DisaggDecision:
    uncached = max(inp.prompt_tokens - inp.cached_tokens, 0)
    if not inp.has_prefill_workers:
        return DisaggDecision(False, uncached, "no prefill workers")
    if inp.prefill_queue_len is None:  # no queue yet, or NATS unreachable: a publish would fail too
        return DisaggDecision(False, uncached, "prefill queue state unknown")
    movable = inp.prompt_tokens // inp.block_size - inp.cached_tokens // inp.block_size
    if movable <= 0:
        return DisaggDecision(False, uncached, f"uncached {uncached} tokens fill no whole {inp.block_size}-token block")
    if uncached <= cfg.max_local_prefill_tokens:
        return DisaggDecision(False, uncached, f"uncached {uncached} <= {cfg.max_local_prefill_tokens} tokens")
    if inp.prefill_queue_len >= cfg.max_prefill_queue:
        return DisaggDecision(False, uncached,
                              f"prefill queue {inp.prefill_queue_len} >= {cfg.max_prefill_queue}")
    return DisaggDecision(True, uncached, "long uncached prompt, queue has room")


def may_go_remote(prompt_tokens: int, cfg: DisaggConfig = DisaggConfig(), block_size: int = 1) -> bool:
    """Whether ``decide_prefill`` could send this prompt remote in the best case (nothing cached,
    prefill workers idle, the queue empty); if not, the decode worker prefills it whatever the split."""
    return decide_prefill(DisaggInput(0.0, prompt_tokens, 0, 0, True, block_size), cfg).remote
