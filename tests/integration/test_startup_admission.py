"""Admission from the first second (real SmolLM2, one decode worker): warm-up measures the worker's
prefill rate on warm kernels and the worker reports it before it takes traffic, so a burst of long
lower-tier prompts arriving right after ``ready`` is predicted and shed (429 ``slo`` with
Retry-After) instead of admitted whole on no rate, and the premium requests that follow are all
admitted. Before, a worker had no rate until its first real prompt and admission let every request
of the burst in."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from shared.telemetry.metrics import sample_total
from stack_helpers import running_stack, stack_spec, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
KEYS = {"premium": "kp", "batch": "kb"}
QOS = """default_tier: batch
tiers:
  premium: {priority: 0, ttft_slo_ms: 4000}
  batch:   {priority: 2, ttft_slo_ms: 4000}
"""
SLO_S = 4.0


def burst_shape(rate: float) -> tuple[int, int]:
    """(requests, words each) for a burst that fits the worker's warm-up rate: one prompt a quarter
    of the SLO (so the first few fit in it), the burst three SLOs of prefill (so most cannot),
    whatever the machine's speed. A word is about one token."""
    words = int(min(max(rate * SLO_S / 4, 64), 1800))
    return int(min(max(3 * SLO_S * rate / words, 16), 200)), words


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    state = tmp_path_factory.mktemp("startup")
    (state / "qos.yaml").write_text(QOS)
    api_keys = ",".join(f"{key}:{tier}" for tier, key in KEYS.items())
    spec = stack_spec(state, "s", nats_server, redis_server, num_decode=1, model=MODEL,
                      decode_flags={"max_model_len": 2048, "kv_cache_memory": "256MiB", "device": "cpu",
                                    "num_warmup_requests": 2},
                      gateway_flags={"qos": str(state / "qos.yaml"), "api_keys": api_keys},
                      admission_flags={"qos": str(state / "qos.yaml")})
    with running_stack(spec, ready_timeout_s=180) as s:
        yield s


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def post(stack, tier: str, prompt: str, max_tokens: int) -> tuple[int, dict, dict]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(stack.base_url + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[tier]}"})
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return resp.status, dict(resp.headers), json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.load(err)


def decided(stack, tier: str) -> float:
    with urllib.request.urlopen(stack.base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(sample_total(text, name, tier=tier) or 0
               for name in ("tandem_gateway_admitted_total", "tandem_gateway_rejected_total"))


def test_a_burst_right_after_ready_sheds_the_lower_tier_and_admits_every_premium_request(stack):
    # at once, as a client that saw /ready would: the rate admission predicts from is warm-up's,
    # in the worker's registry entry (its first load report may not have reached admission yet)
    [info] = wait_for(lambda: [w["info"] for w in get_json(stack.base_url + "/status")["workers"]
                               if w["info"]["role"] == "decode"], 30, "the worker in /status")
    assert info["warmup_prefill_tokens_per_s"] > 0, info
    num_batch, words = burst_shape(info["warmup_prefill_tokens_per_s"])

    outcomes: dict[str, list] = {"batch": [], "premium": []}

    def send(tier: str, prompt: str, max_tokens: int) -> None:
        outcomes[tier].append(post(stack, tier, prompt, max_tokens))

    burst = [threading.Thread(target=send, args=("batch", f"Report {i}. " + "word " * words, 1), daemon=True)
             for i in range(num_batch)]
    for t in burst:
        t.start()
    wait_for(lambda: decided(stack, "batch") >= num_batch, 120, "admission to decide on every batch request")
    premium = [threading.Thread(target=send, args=("premium", f"Premium question {i}: name a colour.", 4), daemon=True)
               for i in range(4)]
    for t in premium:
        t.start()
    for t in premium + burst:
        t.join(600)
        assert not t.is_alive()

    assert [status for status, _, _ in outcomes["premium"]] == [200] * 4, outcomes["premium"]
    shed = [(headers, body) for status, headers, body in outcomes["batch"] if status == 429]
    served = [body for status, _, body in outcomes["batch"] if status == 200]
    assert len(shed) + len(served) == num_batch, [s for s, _, _ in outcomes["batch"]]
    assert shed, "every batch request of the burst was admitted: admission had no prefill rate"
    assert served, "no batch request was admitted: the prediction is far too pessimistic"
    for headers, body in shed:
        assert body["error"]["code"] == "slo" and "predicted TTFT" in body["error"]["message"], body
        assert int(headers["Retry-After"]) >= 1
