"""The simulator's timeline checked against numbers worked out by hand, not by calling the cost
model: a toy model on one device that decodes and prefills locally (the setup
``loadtest/calibrate/sim.py`` compares with the live stack), one or two requests, every event time
written out below.

Toy model and efficiencies: ``toy_model.py``.

* Prefill of 100 tokens: FLOPs 2·1e9·100 + 2·10·1000·100² = 2e11 + 2e8 = 2.002e11 at 5e11 FLOP/s
  = 0.4004 s, + 0.1 s = **0.5004 s**.
* Decode step, batch 1, context 100 + 11/2 = 105.5 (the simulator's mean context):
  read 2e9 + 105.5·40,000 = 2.00422e9 B at 5e10 B/s = 0.0400844 s (FLOPs: 2e9 / 5e11 = 0.004 s,
  less), + 0.01 s = **0.0500844 s**.
* Decode step, batch 2, context 105.5 each: read 2e9 + 2·105.5·40,000 = 2.00844e9 B -> 0.0401688 s
  (FLOPs 0.008 s), + 2·0.01 s = **0.0601688 s**.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from loadtest.calibrate.sim import cpu_cluster_spec, simulate
from toy_model import TOY, TOY_EFF

PREFILL_S, STEP1_S = 0.5004, 0.0500844


def run(tmp_path, arrivals: list[float], input_len: int = 100, output_len: int = 11, **kw) -> dict:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(cpu_cluster_spec(hbm_gib=10.0)))   # room for 2e9 B of weights
    specs = [SimpleNamespace(at_s=t, max_tokens=output_len) for t in arrivals]
    return simulate(cluster, TOY, TOY_EFF, specs, [input_len] * len(arrivals), **kw)


def test_one_request(tmp_path):
    r = run(tmp_path, [0.0])
    assert r["ttft_s"] == [pytest.approx(PREFILL_S, rel=1e-9)]
    # 10 decode steps after the first token, all at batch 1
    assert r["tpot_s"] == [pytest.approx(STEP1_S, rel=1e-9)]


def test_a_prompt_arriving_mid_step_waits_for_the_step_then_stalls_decode(tmp_path):
    # A arrives at 0, first token at 0.5004, then decodes alone at 0.0500844 s per step.
    # B arrives at 0.7: A is (0.7 - 0.5004) / 0.0500844 = 3.985 steps in; step 4 ends at
    # 0.5004 + 4·0.0500844 = 0.7007376, B's prefill runs until 0.7007376 + 0.5004 = 1.2011376.
    #   TTFT(B) = 1.2011376 - 0.7 = 0.5011376
    # Then both decode at 0.0601688 s per step: A's last 6 steps end at 1.2011376 + 6·0.0601688 = 1.5621504.
    #   TPOT(A) = (1.5621504 - 0.5004) / 10 = 0.10617504
    # B's last 4 steps run alone: 1.5621504 + 4·0.0500844 = 1.762488.
    #   TPOT(B) = (1.762488 - 1.2011376) / 10 = 0.05613504
    r = run(tmp_path, [0.0, 0.7])
    assert r["ttft_s"] == [pytest.approx(PREFILL_S, rel=1e-9), pytest.approx(0.5011376, rel=1e-9)]
    assert r["tpot_s"] == [pytest.approx(0.10617504, rel=1e-9), pytest.approx(0.05613504, rel=1e-9)]


def test_a_sequence_finishing_in_the_interrupted_step_is_not_held_by_the_prefill(tmp_path):
    # A's 10th (last) step runs from 0.5004 + 9·0.0500844 = 0.9511596 to 1.001244. B arrives at 0.98:
    # the engine finishes that step (A's last token streams at 1.001244) and then prefills B.
    #   TPOT(A) = (1.001244 - 0.5004) / 10 = 0.0500844
    #   TTFT(B) = 1.001244 + 0.5004 - 0.98 = 0.521644
    r = run(tmp_path, [0.0, 0.98])
    assert r["ttft_s"][1] == pytest.approx(0.521644, rel=1e-9)
    assert r["tpot_s"][0] == pytest.approx(STEP1_S, rel=1e-9)


def two_tiers(ttft_slo_ms: float):
    from shared.policy.admission import AdmissionConfig
    from shared.policy.qos import QosConfig, QosTier

    return AdmissionConfig(QosConfig(default_tier="batch", tiers={
        "premium": QosTier(priority=0, ttft_slo_ms=ttft_slo_ms),
        "batch": QosTier(priority=2, ttft_slo_ms=ttft_slo_ms)}))


def test_local_prefills_go_by_priority_and_admission_counts_the_backlog_ahead(tmp_path):
    # Batch A at 0 prefills until 0.5004. Batch B at 0.01 is predicted 0.4904 s of A's prefill left
    # + its own 0.5004 = 0.9908 s <= 1.2 s: admitted. Batch C at 0.02 would wait for A's rest and
    # B: 0.4804 + 0.5004 + 0.5004 = 1.4812 s > 1.2 s: rejected. Premium P at 0.03 has only A's rest
    # ahead of it (0.4704 + 0.5004 = 0.9708 s): admitted, and prefilled before B, which was queued
    # earlier: P from 0.5004 to 1.0008, B from 1.0008 to 1.5012 (no decode step in between: each
    # prefill starts as the previous one ends).
    #   TTFT(P) = 1.0008 - 0.03 = 0.9708;  TTFT(B) = 1.5012 - 0.01 = 1.4912
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(cpu_cluster_spec(hbm_gib=10.0)))
    arrivals = [0.0, 0.01, 0.02, 0.03]
    specs = [SimpleNamespace(at_s=t, max_tokens=11) for t in arrivals]
    r = simulate(cluster, TOY, TOY_EFF, specs, [100] * 4, admission=two_tiers(1200.0),
                 tiers=["batch", "batch", "batch", "premium"])
    assert r.rejected.tolist() == [False, False, True, False]
    assert r.rejections == {"predicted TTFT over budget": 1}
    assert r.ttft_s[0] == pytest.approx(PREFILL_S, rel=1e-9)
    assert r.ttft_s[3] == pytest.approx(2 * PREFILL_S - 0.03, rel=1e-9)
    assert r.ttft_s[1] == pytest.approx(3 * PREFILL_S - 0.01, rel=1e-9)


def test_the_prefill_queue_serves_by_priority_then_arrival_and_sums_tokens_ahead():
    from shared.sim.simulator import PrefillQueue

    q = PrefillQueue()
    for priority, request, tokens in [(2, 0, 100.0), (2, 1, 50.0), (0, 2, 30.0), (1, 3, 20.0), (0, 4, 10.0)]:
        q.push(priority, request, tokens)
    assert (q.tokens_ahead_of(0), q.tokens_ahead_of(1), q.tokens_ahead_of(2)) == (40.0, 60.0, 210.0)
    assert [q.pop() for _ in range(len(q))] == [2, 4, 3, 0, 1]
    assert q.total_tokens() == 0.0


def test_prompts_queued_behind_a_local_prefill_are_prefilled_together_within_the_step_budget(tmp_path):
    # A prefills alone from 0 to 0.5004. B (0.1) and C (0.2) queue behind it. One prompt per step:
    # B from 0.5004 to 1.0008, C after B. With a 200-token budget B and C (100 tokens each) share
    # the next step, so their first tokens come together, before C's one prompt per step.
    # (A joins the decode batch as that step starts: it is a whole prefill step.)
    serial = run(tmp_path, [0.0, 0.1, 0.2])
    together = run(tmp_path, [0.0, 0.1, 0.2], local_prefill_batch_tokens=200)
    first = lambda r, k, at: at + r["ttft_s"][k]  # noqa: E731
    assert first(serial, 1, 0.1) == pytest.approx(2 * PREFILL_S, rel=1e-9)
    assert first(together, 1, 0.1) == pytest.approx(first(together, 2, 0.2), rel=1e-12)
    assert PREFILL_S < first(together, 2, 0.2) - PREFILL_S < 2 * PREFILL_S   # one step's fixed cost, not two
    assert first(together, 2, 0.2) < first(serial, 2, 0.2)
    # A budget of one prompt: one per step as without one, but a prefill on a worker that is
    # decoding rides in the decode step, its fixed cost (the toy's 0.1 s) paid once. B starts
    # before A has joined the batch (as without a budget); C's prefill runs while A decodes.
    one = run(tmp_path, [0.0, 0.1, 0.2], local_prefill_batch_tokens=100)["ttft_s"]
    assert one[:2] == serial["ttft_s"][:2] and one[2] == pytest.approx(serial["ttft_s"][2] - 0.1, rel=1e-9)
