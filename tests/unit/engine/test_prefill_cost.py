"""The engine's length-aware prefill fit (``shared.engine.step_stats.PrefillCost``), the load
report's estimate from it, and admission counting a long prompt's own tokens by it."""

import dataclasses

import pytest

from shared.engine.step_stats import PrefillCost
from shared.policy.admission import AdmissionConfig, AdmissionInput, Admitter, predict_ttft_s
from shared.policy.qos import QosConfig, QosTier
from shared.protocol import WorkerLoad

A, B = 1.0e-3, 3.0e-7   # about SmolLM2 on one CPU thread: 866 tok/s at 256 tokens, 587 at 2,048


def chunked(fit: PrefillCost, prompt: int, chunk: int = 512, cached: int = 0) -> None:
    """One prompt prefilled alone in chunks, each step timed by the model the fit should find."""
    for start in range(cached, prompt, chunk):
        n = min(chunk, prompt - start)
        attended = n * (2 * start + n)
        fit.observe(n, attended, A * n + B * attended)


def test_the_fit_recovers_both_coefficients_from_prompts_of_several_lengths():
    fit = PrefillCost(min_tokens=16)
    assert fit.coefficients() is None
    chunked(fit, 300, chunk=300)
    assert fit.coefficients() is None          # one step's shape cannot tell the two apart
    for prompt in (200, 2048, 700, 3000, 64):
        chunked(fit, prompt)
    a, b = fit.coefficients()
    assert (a, b) == (pytest.approx(A, rel=1e-6), pytest.approx(B, rel=1e-6))
    fit.observe(8, 64, 1.0)                    # below min_tokens: per-step overhead, not prefill
    assert fit.coefficients() == (pytest.approx(A, rel=1e-6), pytest.approx(B, rel=1e-6))
    fit.forget()
    assert fit.coefficients() is None


def test_a_fit_whose_context_term_comes_out_negative_is_not_reported():
    fit = PrefillCost(min_tokens=16)
    for n, attended, seconds in ((100, 10_000, 0.2), (400, 160_000, 0.3)):   # slower per token when short
        fit.observe(n, attended, seconds)
    assert fit.coefficients() is None


def test_the_load_report_estimates_a_prompt_alone_however_it_is_chunked():
    load = WorkerLoad(worker_id="w", role="decode", seq=1, timestamp=0.0, prefill_cost_s=(A, B))
    assert load.prefill_alone_s(2048, 0) == pytest.approx(A * 2048 + B * 2048 ** 2)
    # the tokens after a cached prefix attend to it too: u (2c + u)
    assert load.prefill_alone_s(512, 1536) == pytest.approx(A * 512 + B * 512 * (2 * 1536 + 512))
    fit = PrefillCost(min_tokens=16)   # steps of another chunk size find the same two coefficients
    for prompt in (200, 2048, 700, 3000, 64):
        chunked(fit, prompt, chunk=128)
    assert fit.coefficients() == (pytest.approx(A, rel=1e-6), pytest.approx(B, rel=1e-6))
    assert WorkerLoad(worker_id="w", role="decode", seq=1, timestamp=0.0).prefill_alone_s(10, 0) is None


def test_admission_counts_a_long_prompt_by_the_fit_where_it_is_slower_than_the_rate():
    qos = QosConfig(default_tier="premium", tiers={"premium": QosTier(priority=0, ttft_slo_ms=3000)})
    admitter = Admitter(AdmissionConfig(qos))
    rate = 780.0                                # the recent rate: mostly prompts of a few hundred tokens
    load = WorkerLoad(worker_id="w", role="decode", seq=1, timestamp=0.0, prefill_cost_s=(A, B))
    base = AdmissionInput(now_s=0.0, tier="premium", prompt_tokens=2257, cached_tokens=16,
                          queued_prefill_tokens=0, prefill_tokens_per_s=rate)
    assert predict_ttft_s(base) == pytest.approx(2241 / rate)          # 2.87 s: admitted at the rate
    assert admitter.decide(base).admitted
    alone = load.prefill_alone_s(2241, 16)                              # 3.77 s with attention's share
    long = dataclasses.replace(base, own_alone_s=alone)
    assert predict_ttft_s(long) == pytest.approx(alone)
    d = admitter.decide(long)
    assert (d.admitted, d.code) == (False, "prompt_too_long") and "alone takes 3.77s" in d.reason
    # a short prompt the fit puts under the rate keeps the rate's (longer) estimate
    short = dataclasses.replace(base, prompt_tokens=200, cached_tokens=0, own_alone_s=load.prefill_alone_s(200, 0))
    assert predict_ttft_s(short) == pytest.approx(200 / rate)
