"""``tandem up --autoscale`` starting and stopping worker processes, on the real SmolLM2: requests
queueing on the one decode worker make the autoscaler ask for a second (and no third: the fleet is
capped at two); once the load is light it stops one while requests are still being served, and
every request completes with the in-process reference's greedy text. The stopped worker exits 0
and the supervisor leaves it stopped; the decisions and their reasons show in ``/status``.
"""

from __future__ import annotations


import openai
import pytest

from stack_helpers import child_lines, cluster_status, running_stack, stack_spec, wait_for
from test_autoscaler import Load, check, short
from test_role_flip import ENGINE, MODEL, engine  # noqa: F401 — fixture

# Slow by design: a second worker loads the model (one thread) while the load runs, then drains; 295 s
# alone on a quiet 2-core machine, past the suite's 600 s default when the machine is busy.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), pytest.mark.long]

# Only queued requests count as load here: a decode capacity far above what a CPU worker produces
# keeps token utilisation near 0, so the light phase is clearly below scale_down_at, and two slots
# per worker make four concurrent streams queue on one worker but not on two. No prefill role: the
# split stays all-decode.
AUTOSCALER = {"autoscale": True, "min_workers": 1, "max_workers": 2, "autoscale_interval_s": 1.0,
              "autoscale_window_s": 4.0, "autoscale_cooldown_s": 4.0, "max_waiting_per_worker": 1.0,
              "decode_capacity_tokens_per_s": 10000.0, "min_prefill_workers": 0, "max_prefill_workers": 0}
# a stopped worker's requests (two slots of 48 tokens) end well within this; the test waits longer
# than it for the exit, so that a drain cut short still ends in an exit whose log says what was left
DRAIN_TIMEOUT_S = 150.0


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    spec = stack_spec(tmp_path_factory.mktemp("fleet"), "f", nats_server, redis_server, num_decode=1, model=MODEL,
                      registry_ttl_s=3.0, decode_flags={**ENGINE, "max_num_seqs": 2, "num_threads": 1},
                      restart_children=True, autoscaler_flags=AUTOSCALER,
                      fleet_drain_timeout_s=DRAIN_TIMEOUT_S)
    with running_stack(spec, ready_timeout_s=300) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def actions(stack, kind: str) -> list[dict]:
    return [a for r in cluster_status(stack)["scaling"]["recent"] for a in r["actions"] if a["kind"] == kind]


def decode_workers(stack) -> dict[str, str]:
    return {w["info"]["worker_id"]: w["info"]["state"] for w in cluster_status(stack)["workers"]}


def test_queued_requests_start_a_worker_and_light_load_stops_one_without_failing_a_request(stack, client, engine):
    """Over a minute because the autoscaler acts on load it has measured for several ticks: a
    worker is started, loads the model and serves, then light load lets it go."""
    with Load(client, short, concurrency=4) as heavy:
        start = wait_for(lambda: actions(stack, "start"), 240, "the autoscaler to start a worker")[0]
        assert start["ok"] and start["role"] == "decode", start
        record = cluster_status(stack)["scaling"]["recent"][-1]
        assert "waiting per worker" in record["reason"] and record["target_decode"] == 2, record
        wait_for(lambda: decode_workers(stack).get(start["worker_id"]) == "ready", 240, f"{start['worker_id']} ready")
        # both slots of both workers busy and more waiting: at max_workers, nothing more is started
        wait_for(lambda: "fleet of 2 kept" in cluster_status(stack)["scaling"]["last_reason"], 60,
                 "a tick that keeps the fleet at max_workers")
        check(heavy.stop(), engine)

    with Load(client, short, concurrency=2) as light:
        stop = wait_for(lambda: actions(stack, "stop"), 240, "the autoscaler to stop a worker")[0]
        assert stop["ok"], stop
        assert "scale down to 1" in cluster_status(stack)["scaling"]["recent"][-1]["reason"]
        name = stack.worker_name(stop["worker_id"])
        child = stack.children[name]
        try:
            wait_for(lambda: not child.is_running(), DRAIN_TIMEOUT_S + 150, f"{name} to drain and exit")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its last lines:\n" + "\n".join(child_lines(stack, name)[-40:])) from None
        assert child.proc.returncode == 0
        theirs = child_lines(stack, name)
        assert not any("cut off" in line for line in theirs), theirs[-40:]
        num_served = len(light.outcomes)
        wait_for(lambda: len(light.outcomes) >= num_served + 4, 240, "requests served after the scale-down")
        check(light.stop(), engine)
    starts = [r["reason"] for r in cluster_status(stack)["scaling"]["recent"]
              if any(a["kind"] == "start" for a in r["actions"])]
    assert len(starts) == 1 and stack.num_restarts(name) == 0, starts
    remaining = [stack.worker_id(n) for n, c in stack.children.items() if n.startswith("decode-") and c.is_running()]
    assert len(remaining) == 1, remaining
    wait_for(lambda: list(decode_workers(stack)) == remaining, 30, f"only {remaining} listed")
    assert any(f"{name} exited (exit code 0)" in l and "not restarted" in l for l in stack.lines), "the exit line"
    assert any("scale down:" in l and name in l for l in stack.lines), "tandem up's scale-down line"
