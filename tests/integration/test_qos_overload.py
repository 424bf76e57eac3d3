"""Two tiers at about three times the stack's capacity (real SmolLM2, one decode worker): premium
requests meet their TTFT SLO at p90, batch requests are turned away with 429 and a Retry-After,
nothing returns 5xx and nothing waits out its timeout.

The capacity is measured first (a burst in a ``probe`` tier without an SLO, below both), then
admission restarts with SLOs set from it: premium's TTFT SLO is four requests' worth of the measured
capacity (4 / capacity: 2.4 s where the stack serves 1.6 requests per second, 15 s on a machine
so loaded that it serves 0.26), batch's twice that. The SLOs are generous relative to the machine
on purpose: on a small shared CPU the stack's speed varies severalfold with other load, and the
check is that overload does not reach premium, not how fast this machine is. At 3x the batch
backlog grows far past any SLO, so batch is shed whatever it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import urllib.error
import urllib.request

import pytest

from loadtest.tools.runner import run_openai
from loadtest.tools.workload import WorkloadConfig, build_workload
from shared.telemetry.measure import percentile
from stack_helpers import running_stack, stack_spec, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
KEYS = {"premium": "kp", "batch": "kb", "probe": "kx"}


def qos_yaml(premium_slo_s: float | None) -> str:
    """The tiers; without SLOs (None) until the capacity is known."""
    slo = (f", ttft_slo_ms: {premium_slo_s * 1000:.0f}", f", ttft_slo_ms: {2 * premium_slo_s * 1000:.0f}") \
        if premium_slo_s else ("", "")
    return (f"default_tier: batch\ntiers:\n  premium: {{priority: 0{slo[0]}}}\n"
            f"  batch:   {{priority: 2{slo[1]}}}\n  probe:   {{priority: 3}}\n")

REQUEST_TIMEOUT_S = 120.0
WORKLOAD = WorkloadConfig(prompt_words=64, output_tokens=16, spread=0.3, seed=3)


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    state = tmp_path_factory.mktemp("qos-overload")
    qos = state / "qos.yaml"
    qos.write_text(qos_yaml(None))
    keys = ",".join(f"{key}:{tier}" for tier, key in KEYS.items())
    spec = stack_spec(state, "o", nats_server, redis_server, num_decode=1, model=MODEL,
                      decode_flags={"device": "cpu", "kv_cache_memory": "256MiB", "max_num_seqs": 8},
                      gateway_flags={"qos": str(qos), "api_keys": keys, "request_timeout_s": REQUEST_TIMEOUT_S},
                      admission_flags={"qos": str(qos)})
    with running_stack(spec, ready_timeout_s=300) as s:
        s.qos_path = qos
        yield s


def restart_admission_with_slos(stack, premium_slo_s: float) -> None:
    stack.qos_path.write_text(qos_yaml(premium_slo_s))
    old = stack.children["admission"]
    old.terminate()
    assert old.wait(30), "admission did not stop"
    spec = stack.spec
    stack.spawn("admission", "admission", {"nats_url": stack.nats_url, "namespace": spec.namespace,
                                           "registry_ttl_s": spec.registry_ttl_s, "log_level": spec.log_level,
                                           "qos": str(stack.qos_path)})

    def admits_premium() -> bool:
        request = urllib.request.Request(
            stack.base_url + "/v1/completions", method="POST",
            data=f'{{"model": "{MODEL}", "prompt": "Hello", "max_tokens": 1}}'.encode(),
            headers={"Authorization": f"Bearer {KEYS['premium']}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                return resp.status == 200 and resp.headers.get("X-Tandem-Tier") == "premium"
        except (urllib.error.URLError, OSError):
            return False

    wait_for(admits_premium, 120, "the restarted admission to admit a premium request")


def run(stack, specs, key_of):
    return asyncio.run(run_openai(stack.base_url, MODEL, specs, progress=False, key_of=key_of,
                                  timeout_s=2 * REQUEST_TIMEOUT_S))


def measure_capacity(stack) -> float:
    """Completed requests per second of a burst that keeps the worker saturated."""
    burst = build_workload(dataclasses.replace(WORKLOAD, num_requests=16, rate=1000.0, seed=11))
    results = run(stack, burst, lambda s: KEYS["probe"])
    ok = [r for r in results if r.error is None]
    assert len(ok) == len(results), [r.error for r in results if r.error]
    return len(ok) / (max(r.finished_s for r in ok) - min(r.started_s for r in ok))


def test_at_three_times_capacity_premium_meets_its_slo_and_batch_is_shed_with_retry_after(stack):
    capacity = measure_capacity(stack)
    premium_slo_s = 4 / capacity
    restart_admission_with_slos(stack, premium_slo_s)
    rate = 3 * capacity
    specs = build_workload(dataclasses.replace(WORKLOAD, num_requests=max(30, round(rate * 20)), rate=rate))
    rng = random.Random(5)
    # premium is a fifth of the load, about 0.6x capacity on its own: at a 0.3 share premium alone
    # ran at 0.9x capacity, where its own queueing (not the batch overload this test is about) set
    # its p90 (a quiet run: 38 of 43 within the SLO)
    tiers = {s.index: "premium" if rng.random() < 0.2 else "batch" for s in specs}
    results = run(stack, specs, lambda s: KEYS[tiers[s.index]])

    by_tier = {t: [r for r in results if tiers[r.index] == t] for t in ("premium", "batch")}
    errors = {r.error for r in results if r.error}
    assert errors <= {"HTTP 429"}, f"only 429s expected (no 5xx, no timeout): {errors}"
    premium_ok = [r for r in by_tier["premium"] if r.error is None]
    premium_ttfts = [r.ttft_s for r in premium_ok]
    summary = (f"capacity {capacity:.2f} req/s, premium SLO {premium_slo_s:.1f}s, {len(specs)} requests at "
               f"{rate:.2f} req/s; premium "
               f"{len(premium_ok)}/{len(by_tier['premium'])} ok, TTFT p50 {percentile(premium_ttfts, 50)}, "
               f"p90 {percentile(premium_ttfts, 90)}")
    # p90 over every premium request sent: a rejected one counts as a miss
    premium_met = [r for r in premium_ok if r.ttft_s <= premium_slo_s]
    assert len(premium_met) >= 0.9 * len(by_tier["premium"]), summary
    shed = [r for r in by_tier["batch"] if r.error == "HTTP 429"]
    assert shed, f"no batch request was shed at 3x: {summary}"
    assert all(r.retry_after_s is not None and r.retry_after_s >= 1 for r in shed), \
        [r.retry_after_s for r in shed]
    max_tokens = {s.index: s.max_tokens for s in specs}
    assert all(r.num_output_tokens == max_tokens[r.index] for r in results if r.error is None)
