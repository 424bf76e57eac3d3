"""The autoscaler acting on its own: two decode workers on the real SmolLM2; short prompts with long
outputs leave the split alone, a shift to long prompts with short outputs makes the autoscaler flip
a decode worker to prefill, and the shift back flips it back. The decode workers report the short
prompts as theirs to prefill whatever the split. Every request served meanwhile
completes with the in-process reference's greedy text; the decisions show in ``/status``.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest

from stack_helpers import cluster_status, running_stack, stack_spec, wait_for
from test_role_flip import ENGINE, LONG_DOC, MODEL, engine, greedy, streamed  # noqa: F401 — fixture

pytestmark = [pytest.mark.slow, pytest.mark.long]

# Small interval, window, cooldown and stabilization window so the test sees decisions soon.
# On a small shared CPU the workers measure prefill rates of tens of tokens per second and decode a
# few tokens per second; the decode capacity is set to match, so that either mix is clear-cut.
AUTOSCALE = {"autoscale": True, "autoscale_interval_s": 2.0, "autoscale_window_s": 10.0,
             "autoscale_cooldown_s": 6.0, "autoscale_stabilization_s": 4.0, "min_prefill_workers": 0,
             "min_decode_workers": 1, "decode_capacity_tokens_per_s": 2.0}


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    spec = stack_spec(tmp_path_factory.mktemp("autoscale"), "a", nats_server, redis_server, num_decode=2, model=MODEL,
                      registry_ttl_s=3.0, decode_flags={**ENGINE, "drain_timeout_s": 60})
    with running_stack(spec, ready_timeout_s=300) as s:
        passive = s.children.pop("autoscaler")  # the stack's own autoscaler only serves the view
        passive.terminate()
        assert passive.wait(30)
        s.spawn("autoscaler", "autoscaler", {"nats_url": s.nats_url, "namespace": spec.namespace,
                                             "registry_ttl_s": spec.registry_ttl_s, **AUTOSCALE})
        wait_for(lambda: (cluster_status(s).get("scaling") or {}).get("enabled"), 60, "the acting autoscaler")
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


class Load:
    """Requests from ``make(i)`` → (prompt, max_tokens), ``concurrency`` at a time, until stopped
    (or ``max_s`` passed: a test that fails before stopping it leaves no sender behind); keeps every
    outcome (text or the error's repr) to check afterwards.

    The senders are daemon threads, never joined at interpreter exit, so a request stuck in a broken
    stack cannot keep pytest from exiting; ``stop`` fails naming a sender still stuck after
    ``join_s``. A context manager: leaving the block stops the senders even when the test fails
    inside it.
    """

    def __init__(self, client, make, concurrency: int = 2, max_s: float = 900.0) -> None:
        self.outcomes: list[tuple[str, int, object]] = []
        self._stop = threading.Event()
        self._concurrency = concurrency
        self._deadline = time.monotonic() + max_s
        self._threads = [threading.Thread(target=self._loop, args=(client, make, k), daemon=True,
                                          name=f"load-{k}") for k in range(concurrency)]
        for thread in self._threads:
            thread.start()

    def _loop(self, client, make, k: int) -> None:
        i = k
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            prompt, max_tokens = make(i)
            try:
                outcome: object = streamed(client, prompt, max_tokens)
            except Exception as exc:  # noqa: BLE001 — checked by the test
                outcome = Failed(repr(exc))
                self._stop.wait(1.0)  # a stack that is down fails at once: do not spin
            self.outcomes.append((prompt, max_tokens, outcome))
            i += self._concurrency

    def stop(self, join_s: float = 300.0) -> list[tuple[str, int, object]]:
        self._stop.set()
        deadline = time.monotonic() + join_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        assert not stuck, f"{', '.join(stuck)}: a request still unanswered {join_s:g}s after the load stopped"
        return self.outcomes

    def __enter__(self) -> "Load":
        return self

    def __exit__(self, *exc_info) -> None:
        if exc_info[0] is None:
            self.stop()
        else:  # the test already failed: stop the senders, report that failure, not a stuck one
            self._stop.set()


class Failed(str):
    """A request's error, kept as text (an exception would keep its frames alive)."""


def scaling(stack) -> dict:
    return cluster_status(stack)["scaling"]


def roles(stack) -> dict[str, tuple[str, str]]:
    return {w["info"]["worker_id"]: (w["info"]["role"], w["info"]["state"]) for w in cluster_status(stack)["workers"]}


def flips_to(stack, role: str) -> list[dict]:
    return [a for r in scaling(stack)["recent"] for a in r["actions"] if a["kind"] == "flip" and a["role"] == role]


def short(i: int) -> tuple[str, int]:
    return f"Story {i}: once upon a time, in a small village by the sea,", 48


def long(i: int) -> tuple[str, int]:
    return f"Document {i}. " + LONG_DOC * 2 + " The document above is about", 1


def check(outcomes, engine) -> None:
    assert outcomes, "no request completed"
    for prompt, max_tokens, outcome in outcomes:
        assert not isinstance(outcome, Failed), f"{prompt[:30]!r} failed: {outcome}"
        assert outcome == greedy(engine, prompt, max_tokens), prompt[:30]


def test_a_shift_to_long_prompts_flips_a_decode_worker_to_prefill_and_back(stack, client, engine):
    """Over a minute because each flip waits for the autoscaler to see the mix change over its
    window, then for the worker to drain and change role, twice."""
    with Load(client, short) as load:
        wait_for(lambda: len(load.outcomes) >= 4 and (d := scaling(stack)["last_decision"]) and d["decode_tokens_per_s"] > 0
                 and d["reason"].startswith("balanced"), 240, "a decision on the decode-heavy mix")
        assert scaling(stack)["recent"] == [], scaling(stack)["recent"]
        assert all(r == "decode" for r, _ in roles(stack).values())
        # short prompts are prefilled by the decode workers whatever the split: reported as such
        assert scaling(stack)["last_decision"]["local_prefill_tokens_per_s"] > 0, scaling(stack)["last_decision"]
    check(load.outcomes, engine)

    with Load(client, long) as load:
        flip = wait_for(lambda: flips_to(stack, "prefill"), 180, "the autoscaler to flip a worker to prefill")[0]
        assert flip["ok"], flip
        record = scaling(stack)["recent"][-1]
        assert (record["num_prefill"], record["target_prefill"], record["target_decode"]) == (0, 1, 1), record
        assert record["prefill_tokens_per_s"] > record["decode_tokens_per_s"], record
        # long enough for a remote prefill: most of the demand is prefill-worker work
        assert record["local_prefill_tokens_per_s"] < record["prefill_tokens_per_s"] / 2, record
        wait_for(lambda: roles(stack).get(flip["worker_id"]) == ("prefill", "ready"), 120,
                 f"{flip['worker_id']} serving as prefill")
    check(load.outcomes, engine)

    with Load(client, short) as load:
        back = wait_for(lambda: flips_to(stack, "decode"), 180, "the autoscaler to flip the worker back")[0]
        assert back["ok"] and back["worker_id"] == flip["worker_id"], back
        wait_for(lambda: roles(stack).get(flip["worker_id"]) == ("decode", "ready"), 120,
                 f"{flip['worker_id']} serving as decode again")
    check(load.outcomes, engine)
    assert any("scaling:" in l and "prefill share" in l and "flipping" in l for l in stack.lines), "the log line"
