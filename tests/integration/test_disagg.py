"""Disaggregated prefill end to end: gateway → admission → decode worker → JetStream prefill queue →
prefill worker → NIXL write into the decode worker's blocks → tokens, all as separate processes on
the real SmolLM2 with real nats-server, redis-server and NIXL (UCX over DRAM).

Every prompt with an uncached part goes remote (``--max-local-prefill-tokens 0``). Tests run in file
order: the fault tests at the end stall or kill prefill workers and start others.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import openai
import pytest

from shared.protocol import RemotePrefillRequest, Subjects
from stack_helpers import greedy_text, reference_engine_fixture, require_nixl, running_stack, stack_spec, wait_for

require_nixl()

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 2048
BLOCK = 16
# the decode worker's window for a remote prefill. A request whose prefill worker dies is
# redelivered ACK_WAIT_S after its last progress report; the prefill worker's lease on the blocks
# (LEASE_S, renewed while it works) outlasts that, so the second prefill worker claims the
# reservation before the first one's lease lapses (redelivery, not the local fallback, is what
# finishes such a request), and a duplicate delivery still holds a lease long enough to write
FALLBACK_S = 40.0
ACK_WAIT_S = 3.0
LEASE_S = 15.0  # > ACK_WAIT_S + the second worker connecting, with room on a busy machine
ENGINE = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "160MiB", "device": "cpu", "num_warmup_requests": 1}
LONG_DOC = ("Tandem moves the KV cache of long prompts from prefill workers to decode workers. "
            "Each block of sixteen tokens holds every layer's keys and values. ") * 14  # ~420 tokens


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    spec = stack_spec(tmp_path_factory.mktemp("disagg"), "d", nats_server, redis_server, num_decode=1, num_prefill=1,
                      model=MODEL, registry_ttl_s=3.0,
                      decode_flags={**ENGINE, "max_local_prefill_tokens": 0, "remote_prefill_timeout_s": FALLBACK_S,
                                    "prefill_lease_s": LEASE_S, "drain_timeout_s": 10},
                      prefill_flags={**ENGINE, "ack_wait_s": ACK_WAIT_S, "drain_timeout_s": 10})
    with running_stack(spec, ready_timeout_s=240) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=180)


engine = reference_engine_fixture(MODEL, MAX_MODEL_LEN, 160 << 20)


def greedy(engine, prompt_ids: list[int], max_tokens: int) -> str:
    return greedy_text(engine, prompt_ids, max_tokens)


def worker_load(stack, role: str) -> dict:
    """The one ``role`` worker's last load report, waiting for its first (a worker is in /status as
    soon as it registers, its load once its first report has reached the gateway)."""
    from urllib.request import urlopen

    def read() -> tuple[dict, list[dict]] | None:
        with urlopen(stack.base_url + "/status", timeout=10) as resp:
            view = json.load(resp)
        loads = [w["load"] for w in view["workers"] if w["info"]["role"] == role and w["load"]]
        return (view, loads) if loads else None

    view, loads = wait_for(read, what=f"a {role} worker's load report")
    assert len(loads) == 1, view
    return {**loads[0], "prefill_queue": view.get("prefill_queue")}


def wait_for_decode_kv_freed(stack, timeout_s: float) -> dict:
    """The decode worker's pool has no used and no held blocks (cached blocks are free ones)."""
    last: dict = {}

    def freed() -> bool:
        last.update(worker_load(stack, "decode"))
        return last["num_blocks_used"] == 0 and last["num_held"] == 0

    try:
        wait_for(freed, timeout_s, what="the decode worker's blocks to go back to the pool")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: last report {last['num_blocks_used']} used, {last['num_held']} held, "
                             f"{last['num_running']} running") from None
    return last


def in_background(fn, *args) -> Future:
    """Run ``fn(*args)`` in a thread: ``.result(timeout)`` returns its value or raises its exception."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def wait_for_prefill_start(stack, num_tokens: int) -> tuple[str, str]:
    """(child name, request id) of the prefill worker that started on a prompt of ``num_tokens``."""
    line = wait_for(lambda: next((l for l in stack.lines if l.startswith("prefill-")
                                  and f"prefilling {num_tokens} tokens" in l), None),
                    timeout_s=60, what=f"a prefill of {num_tokens} tokens to start")
    return line.split("|", 1)[0], line.split(": ")[1]


def logged(stack, child: str, request_id: str, text: str) -> list[str]:
    return [l for l in stack.lines if l.startswith(f"{child}|") and f"{request_id}: {text}" in l]


def completion(client, prompt: str, max_tokens: int = 24):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0)
    return raw.parse()


def expected_bytes(stack, engine, num_prompt: int, num_cached: int) -> int:
    """The KV of the uncached part's full blocks (the partial tail is recomputed by the decode)."""
    return (num_prompt // BLOCK - num_cached // BLOCK) * engine.kv_spec.bytes_per_block


def test_remote_prefill_equals_the_aggregated_path(stack, client, engine):
    tok = engine.tokenizer
    before = worker_load(stack, "decode")
    prompts = ["In one short paragraph, explain to a curious child why the sky looks blue at noon:",  # 1 block
               LONG_DOC + "Summarise the text above in one sentence:"]
    received = before["kv_bytes_received"]
    for i, prompt in enumerate(prompts):
        ids = tok.encode(prompt)
        reply = completion(client, prompt)
        assert reply.choices[0].text == greedy(engine, ids, 24), prompt[:40]
        assert reply.usage.prompt_tokens == len(ids)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        received += expected_bytes(stack, engine, len(ids), cached)
        load = wait_for(lambda: (l := worker_load(stack, "decode"))["num_remote_prefills"]
                        >= before["num_remote_prefills"] + i + 1 and l, what="the decode load report")
        # the bytes NIXL moved are exactly the KV of the uncached part's full blocks
        assert load["kv_bytes_received"] == received
    assert load["num_local_prefills"] == before["num_local_prefills"]
    assert load["num_prefill_fallbacks"] == before["num_prefill_fallbacks"]
    prefill = worker_load(stack, "prefill")
    assert prefill["kv_bytes_sent"] >= received > 0
    assert prefill["prefill_queue"] == {"num_pending": 0, "num_ack_pending": 0, "num_redelivered": 0,
                                        "num_waiting_pulls": prefill["prefill_queue"]["num_waiting_pulls"],
                                        "num_pending_by_level": [0, 0, 0]}


def test_blocks_are_held_through_the_lease_then_freed(stack, client, engine):
    """A finished remote request keeps its reserved blocks (a late or repeated write may still land
    in them) until the prefill worker's lease on them expires, at most LEASE_S after its last
    renewal; then every block of every disaggregated request so far is back in the pool."""
    before = worker_load(stack, "decode")
    prompt = ("A decode worker reserves blocks for a prompt, a prefill worker computes and writes them, "
              "and the decode worker then")  # a whole uncached block at least: it goes remote
    reply = completion(client, prompt, max_tokens=8)
    assert reply.choices[0].text == greedy(engine, engine.tokenizer.encode(prompt), 8)
    load = wait_for(lambda: (l := worker_load(stack, "decode"))["num_remote_prefills"]
                    > before["num_remote_prefills"] and l["num_running"] == 0 and l["num_held"] >= 1 and l,
                    what="the finished remote request's blocks to be held")
    assert load["num_blocks_used"] >= 1
    wait_for_decode_kv_freed(stack, LEASE_S + 30)


def test_a_cached_prefix_is_not_moved_again(stack, client, engine):
    tok = engine.tokenizer
    first = LONG_DOC + "Question: what moves the KV cache?"
    completion(client, first, max_tokens=4)
    before = worker_load(stack, "decode")
    second = LONG_DOC + "Question: how many tokens does a block hold? Answer briefly."
    ids = tok.encode(second)
    reply = completion(client, second)
    assert reply.choices[0].text == greedy(engine, ids, 24)
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert cached >= (len(tok.encode(LONG_DOC)) // BLOCK - 1) * BLOCK  # the shared document stayed put
    want = before["kv_bytes_received"] + expected_bytes(stack, engine, len(ids), cached)
    wait_for(lambda: worker_load(stack, "decode")["kv_bytes_received"] == want, what=f"{want} bytes received")
    assert expected_bytes(stack, engine, len(ids), cached) < expected_bytes(stack, engine, len(ids), 0) // 4


def test_thresholds_change_at_run_time_through_the_control_subject(stack, client, engine, capsys):
    from shared.bus import Bus
    from shared.protocol import ControlRequest

    worker_id = f"{stack.spec.namespace}-decode-1"

    async def configure(**kw):
        bus = await Bus.connect(stack.nats_url, "test-control")
        try:
            return await bus.request(Subjects(stack.spec.namespace).control(worker_id),
                                     ControlRequest(action="configure" if kw else "status", **kw), timeout_s=10)
        finally:
            await bus.close()

    result = asyncio.run(configure(max_local_prefill_tokens=100_000))
    assert result.max_local_prefill_tokens == 100_000 and result.state == "ready"
    try:
        before = worker_load(stack, "decode")
        prompt = "Kyoto was the capital of Japan for more than a thousand years because"
        assert completion(client, prompt).choices[0].text == greedy(engine, engine.tokenizer.encode(prompt), 24)
        after = wait_for(lambda: (l := worker_load(stack, "decode"))["num_local_prefills"]
                         > before["num_local_prefills"] and l, what="a local prefill")
        assert after["num_remote_prefills"] == before["num_remote_prefills"]
    finally:  # back to all-remote, through the CLI this time
        from services.cli import main

        assert main(["control", worker_id, "--nats-url", stack.nats_url, "--namespace", stack.spec.namespace,
                     "--max-local-prefill-tokens", "0"]) == 0
        assert json.loads(capsys.readouterr().out)["max_local_prefill_tokens"] == 0
        assert asyncio.run(configure()).max_local_prefill_tokens == 0


def test_a_duplicate_delivery_is_harmless(stack, client, engine):
    """The same RemotePrefillRequest twice on the queue: two writes, two notifications; the decode
    worker takes the first and streams every token once."""
    tok = engine.tokenizer
    subjects = Subjects(stack.spec.namespace)
    prompt = LONG_DOC[:600] + "Write one more sentence about decode workers:"
    ids = tok.encode(prompt)
    copied = threading.Event()

    async def duplicate_the_next_request(ready: threading.Event, done: threading.Event):
        from shared.bus import Bus

        bus = await Bus.connect(stack.nats_url, "test-duplicator")
        try:
            sub = await bus.nc.subscribe(subjects.prefill_queue().subject)
            ready.set()
            msg = await sub.next_msg(timeout=60)
            await bus.js.publish(msg.subject, msg.data)  # a second copy in the work queue
            done.set()
            return RemotePrefillRequest.from_bytes(msg.data)
        finally:
            await bus.close()

    ready, result = threading.Event(), {}
    thread = threading.Thread(target=lambda: result.update(req=asyncio.run(duplicate_the_next_request(ready, copied))))
    thread.start()
    assert ready.wait(30)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in stream)
    thread.join(60)
    assert copied.is_set() and result["req"].prompt_token_ids == ids
    assert text == greedy(engine, ids, 24)
    transfer_id = result["req"].transfer_id
    # both copies were served by the prefill worker, and the decode worker ignored the second notification
    wait_for(lambda: sum("wrote" in l and result["req"].request_id in l for l in stack.lines) == 2,
             what="two writes")
    wait_for(lambda: any("repeated KV notification" in l and result["req"].request_id in l for l in stack.lines),
             what="the ignored notification")
    assert transfer_id
    queue = wait_for(lambda: (q := worker_load(stack, "prefill")["prefill_queue"])["num_ack_pending"] == 0 and q,
                     what="an empty queue")
    assert queue["num_pending"] == 0


def test_a_request_for_a_gone_decode_worker_is_dropped_and_the_worker_keeps_serving(stack, client, engine):
    subjects = Subjects(stack.spec.namespace)
    before = worker_load(stack, "prefill")
    ghost = RemotePrefillRequest(
        request_id="ghost-1", transfer_id=uuid.uuid4().hex, model=MODEL, prompt_token_ids=list(range(100, 180)),
        decode_worker_id="decode-that-left", block_ids=list(range(5)), block_size=BLOCK,
        write_deadline=time.time() + 60, write_timeout_s=5.0)

    async def publish():
        from shared.bus import Bus

        bus = await Bus.connect(stack.nats_url, "test-ghost")
        try:
            await bus.js_publish(subjects.prefill_queue(), ghost)
        finally:
            await bus.close()

    asyncio.run(publish())
    after = wait_for(lambda: (l := worker_load(stack, "prefill"))["num_prefills_dropped"]
                     > before["num_prefills_dropped"] and l, what="the drop")
    assert after["prefill_queue"]["num_pending"] == 0 and after["prefill_queue"]["num_ack_pending"] == 0
    prompt = "Decode workers stream tokens while prefill workers"
    assert completion(client, prompt).choices[0].text == greedy(engine, engine.tokenizer.encode(prompt), 24)


def test_a_stalled_prefill_worker_loses_its_lease_into_a_local_prefill_and_frees_the_blocks(stack, client, engine):
    """SIGSTOP the only prefill worker once it prefills a long prompt: its lease lapses (LEASE_S),
    so the decode worker prefills locally; its blocks go back to the pool with the request.
    Resumed, the prefill worker is refused the lease and drops the request unwritten."""
    tok = engine.tokenizer
    prompt = (LONG_DOC * 4)[:5200] + "Which component receives the blocks?"
    ids = tok.encode(prompt)
    before = worker_load(stack, "decode")
    reply = in_background(completion, client, prompt)
    stalled, request_id = wait_for_prefill_start(stack, len(ids))
    pid = stack.children[stalled].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        text = reply.result(timeout=FALLBACK_S + 120).choices[0].text
    finally:
        os.kill(pid, signal.SIGCONT)
    assert text == greedy(engine, ids, 24)
    assert logged(stack, "decode-1", request_id, "the prefill worker's lease lapsed"), "no lapse fallback"
    after = wait_for(lambda: (l := worker_load(stack, "decode"))["num_prefill_fallbacks"]
                     > before["num_prefill_fallbacks"] and l, what="the fallback in a load report")
    assert after["num_prefill_fallbacks"] == before["num_prefill_fallbacks"] + 1
    assert after["num_remote_prefills"] == before["num_remote_prefills"]
    wait_for_decode_kv_freed(stack, 30)  # the lease has lapsed: nothing waits for a write any more
    wait_for(lambda: logged(stack, stalled, request_id, "dropped: "),
             what="the resumed prefill worker to drop the request")
    assert not logged(stack, stalled, request_id, "wrote")
    wait_for(lambda: (q := worker_load(stack, "prefill")["prefill_queue"])["num_pending"] == 0
             and q["num_ack_pending"] == 0, what="an empty prefill queue")
    stack.wait_ready(timeout_s=60, num_prefill=1)


def test_prefill_worker_killed_mid_prefill_the_request_is_redelivered(stack, client, engine):
    """Two prefill workers; SIGKILL the one prefilling a long prompt. Its progress reports stop, so
    the queue redelivers the request to the other ACK_WAIT_S later, well inside the decode worker's
    window: the KV arrives from the second delivery and nothing falls back to a local prefill."""
    tok = engine.tokenizer
    stack.spawn_prefill("prefill-2")
    stack.wait_ready(timeout_s=180, num_prefill=2)
    prompt = (LONG_DOC * 4)[:6000] + "What is this text about?"
    ids = tok.encode(prompt)
    assert len(ids) > 1000
    before = worker_load(stack, "decode")
    reply = in_background(completion, client, prompt)
    victim, request_id = wait_for_prefill_start(stack, len(ids))
    survivor = ({"prefill-1", "prefill-2"} - {victim}).pop()
    child = stack.children.pop(victim)
    child.kill()
    assert child.wait(10)
    assert reply.result(timeout=FALLBACK_S + 120).choices[0].text == greedy(engine, ids, 24)
    assert not logged(stack, victim, request_id, "wrote"), "the victim wrote the KV before it was killed"
    assert logged(stack, survivor, request_id, "delivery 2"), f"{survivor} did not get the second delivery"
    assert logged(stack, survivor, request_id, "wrote")
    done = before["num_remote_prefills"] + before["num_prefill_fallbacks"]
    after = wait_for(lambda: (l := worker_load(stack, "decode"))["num_remote_prefills"]
                     + l["num_prefill_fallbacks"] > done and l, what="the request in a load report")
    assert after["num_remote_prefills"] == before["num_remote_prefills"] + 1
    assert after["num_prefill_fallbacks"] == before["num_prefill_fallbacks"]
    assert not logged(stack, "decode-1", request_id, "no KV from a prefill worker")
    wait_for_decode_kv_freed(stack, FALLBACK_S + 30)
    # the survivor serves the next request remotely
    stack.wait_ready(timeout_s=120, num_prefill=1)
    again = "After the failure, the other prefill worker went on computing the prompts of the decode worker, which"
    assert completion(client, again).choices[0].text == greedy(engine, tok.encode(again), 24)
    wait_for(lambda: worker_load(stack, "decode")["num_remote_prefills"] > after["num_remote_prefills"],
             what="a remote prefill by the survivor")


def test_decode_worker_killed_before_the_transfer_the_prefill_worker_drops_it_and_keeps_serving(
        stack, client, engine):
    """Two decode workers; SIGKILL the one whose request a prefill worker is computing. Its NIXL
    metadata is still published, so the write is attempted and fails: the prefill worker drops the
    request and keeps serving, and the gateway admits the request again (no token was sent yet) to
    the other decode worker, where it completes."""
    tok = engine.tokenizer
    stack.spawn_decode("decode-2")
    stack.wait_ready(timeout_s=180, num_decode=2)
    prompt = (LONG_DOC * 4)[:6400] + "Which workers are named in this text?"
    ids = tok.encode(prompt)
    reply = in_background(completion, client, prompt)
    started = wait_for(lambda: next((l for l in stack.lines if l.startswith("prefill-")
                                     and f"prefilling {len(ids)} tokens" in l), None),
                       timeout_s=60, what="the prefill to start")
    request_id = started.split(": ")[1]
    victim_id = started.rsplit(" at ", 1)[1].rstrip(")")
    victim = stack.children.pop(victim_id.removeprefix(f"{stack.spec.namespace}-"))
    victim.kill()
    victim.wait(10)
    wait_for(lambda: any("dropped" in l and request_id in l for l in stack.lines), timeout_s=60,
             what="the prefill worker to drop the request")
    # the client sees no error: the request's own exception, if any, fails the test here
    assert reply.result(timeout=180).choices[0].text == greedy(engine, ids, 24)
    wait_for(lambda: not any(w["info"]["worker_id"] == victim_id for w in _workers(stack)),
             what="the killed worker to leave the registry")
    before = worker_load(stack, "decode")
    prompt = "Once the other decode worker takes over, the prefill worker writes the KV of long prompts into it:"
    assert completion(client, prompt).choices[0].text == greedy(engine, tok.encode(prompt), 24)
    wait_for(lambda: worker_load(stack, "decode")["num_remote_prefills"] > before["num_remote_prefills"],
             what="a remote prefill on the surviving worker")


def _workers(stack) -> list[dict]:
    from urllib.request import urlopen

    with urlopen(stack.base_url + "/status", timeout=10) as resp:
        return json.load(resp)["workers"]
