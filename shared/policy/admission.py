"""Admission: accept or reject a request before any work is done (early rejection).

A request is rejected when its predicted TTFT exceeds its tier's budget (SLO x slack), when its
tier's queue is full, or when the prompt is too long. Predicted TTFT is the time to drain the
prefill work ahead of it plus its own prefill, at the pool's measured token rate, plus the KV
transfer, plus any wait for KV memory on the decode worker. Higher tiers get more slack and longer queues, so under overload the lowest tier is
shed first (QoS). Rejections carry ``retry_after_s`` for the gateway's Retry-After header.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class QosTier:
    name: str
    ttft_slack: float = 1.0     # admit while predicted TTFT <= ttft_slo_s * ttft_slack
    max_queued: int = 10_000    # requests of this tier waiting for prefill


def _default_tiers() -> dict[str, QosTier]:
    return {"premium": QosTier("premium", ttft_slack=2.0, max_queued=100_000),
            "standard": QosTier("standard", ttft_slack=1.0, max_queued=10_000),
            "batch": QosTier("batch", ttft_slack=0.5, max_queued=1_000)}


@dataclass(frozen=True)
class AdmissionConfig:
    ttft_slo_s: float
    max_prompt_tokens: int = 131_072
    retry_after_s: float = 1.0
    tiers: Mapping[str, QosTier] = field(default_factory=_default_tiers)


@dataclass(frozen=True)
class AdmissionInput:
    now_s: float
    tier: str
    prompt_tokens: int
    cached_tokens: int
    queued_prefill_tokens: float    # uncached tokens waiting or in progress ahead of this request
    prefill_tokens_per_s: float     # the prefill pool's aggregate rate (measured or planned)
    queued_requests: int            # requests of this tier already waiting
    transfer_s: float = 0.0         # expected KV transfer time
    decode_wait_s: float = 0.0      # expected wait for KV memory on the chosen decode worker


@dataclass(frozen=True)
class AdmissionDecision:
    admitted: bool
    reason: str
    predicted_ttft_s: float
    retry_after_s: float = 0.0


def predict_ttft_s(inp: AdmissionInput) -> float:
    if inp.prefill_tokens_per_s <= 0:
        return float("inf")
    own = max(inp.prompt_tokens - inp.cached_tokens, 0)
    return (inp.queued_prefill_tokens + own) / inp.prefill_tokens_per_s + inp.transfer_s + inp.decode_wait_s


def admit(inp: AdmissionInput, cfg: AdmissionConfig) -> AdmissionDecision:
    tier = cfg.tiers.get(inp.tier)
    if tier is None:
        raise ValueError(f"unknown tier {inp.tier!r}; tiers: {sorted(cfg.tiers)}")
    ttft = predict_ttft_s(inp)
    if inp.prompt_tokens > cfg.max_prompt_tokens:
        return AdmissionDecision(False, f"prompt {inp.prompt_tokens} > {cfg.max_prompt_tokens} tokens", ttft)
    if inp.queued_requests >= tier.max_queued:
        return AdmissionDecision(False, f"tier {tier.name} queue full ({inp.queued_requests})", ttft,
                                 cfg.retry_after_s)
    budget = cfg.ttft_slo_s * tier.ttft_slack
    if ttft > budget:
        # Retry once the backlog ahead would have drained to the budget.
        wait = max(ttft - budget, cfg.retry_after_s)
        return AdmissionDecision(False, f"predicted TTFT {ttft:.2f}s > {budget:.2f}s", ttft, wait)
    return AdmissionDecision(True, "ok", ttft)
