"""Files, batches and stored responses belong to the API key that made them, and background
responses wait out admission's 429s; on a real stack (real SmolLM2, one decode worker, real NATS
and Redis) with API keys configured, through the official ``openai`` client.

Key B cannot read, list, delete or cancel key A's file, batch or response, start a batch from A's
file, nor continue A's conversation: a 404, as if they did not exist; each key lists its own, a
batch's result files are its owner's, and records stored before owners were recorded (no owner)
are no key's. A background response that admission sheds (429) is asked again after the
Retry-After until it runs, gives up at ``background_retry_max_wait_s`` with the last rejection, or
is cancelled while it waits.

Tiers: ``standard`` (keys A and B), ``tight`` (a 20 ms SLO that a short prompt meets alone but
not right after a long ``standard`` prompt: the higher tier's arrivals count in its prediction, so
it misses, and admission then sheds the tiers below it for ``shed_hold_s``) and ``low`` below it
(the key of the retry tests; batch lines run in the lowest tier, so the batch test comes before
them).
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
import uuid

import openai
import pytest
from stack_helpers import cluster_status, running_stack, stack_spec, wait_for

from shared.bus import Bus
from shared.openai_api.batch.store import FileStore
from shared.openai_api.stored.store import ResponseStore
from shared.protocol import Subjects
from shared.protocol.batch import FileRecord
from shared.protocol.responses import StoredResponse

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
QOS = """default_tier: standard
tiers:
  standard: {priority: 0, ttft_slo_ms: 600000}
  tight:    {priority: 1, ttft_slo_ms: 20}
  low:      {priority: 2, ttft_slo_ms: 600000}
"""
KEYS = {"a": "sk-owner-a", "b": "sk-owner-b", "tight": "sk-tight", "low": "sk-low"}
SHED_HOLD_S = 3.0
MAX_RETRY_WAIT_S = 6.0
FINAL = ("completed", "incomplete", "failed", "cancelled")


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    state = tmp_path_factory.mktemp("owners")
    (state / "qos.yaml").write_text(QOS)
    api_keys = f"{KEYS['a']},{KEYS['b']},{KEYS['tight']}:tight,{KEYS['low']}:low"
    spec = stack_spec(state, "o", nats_server, redis_server, num_decode=1, model=MODEL,
                      gateway_flags={"qos": str(state / "qos.yaml"), "api_keys": api_keys, "batch_max_in_flight": 2,
                                     "background_retry_max_wait_s": MAX_RETRY_WAIT_S},
                      admission_flags={"qos": str(state / "qos.yaml"), "shed_hold_s": SHED_HOLD_S},
                      decode_flags={"max_model_len": 1024, "kv_cache_memory": "64MiB", "device": "cpu",
                                    "num_warmup_requests": 1})
    with running_stack(spec, ready_timeout_s=180) as s:
        yield s


def client_for(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def a(stack):
    return client_for(stack, KEYS["a"])


@pytest.fixture(scope="module")
def b(stack):
    return client_for(stack, KEYS["b"])


def not_found(call) -> dict:
    """The body of the 404 that ``call`` gets."""
    with pytest.raises(openai.NotFoundError) as info:
        call()
    return info.value.body


def batch_input(*custom_ids: str) -> io.BytesIO:
    lines = [{"custom_id": c, "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2,
                       "temperature": 0}} for c in custom_ids]
    return io.BytesIO(b"".join(json.dumps(l).encode() + b"\n" for l in lines))


def test_a_file_is_its_keys_only(stack, a, b):
    mine = a.files.create(file=("a.jsonl", batch_input("x")), purpose="batch")
    theirs = b.files.create(file=("b.jsonl", batch_input("y")), purpose="batch")
    for call in (lambda: b.files.retrieve(mine.id), lambda: b.files.content(mine.id),
                 lambda: b.files.delete(mine.id)):
        assert not_found(call)["code"] == "file_not_found"
    refused = not_found(lambda: b.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h"))
    assert (refused["code"], refused["param"]) == ("file_not_found", "input_file_id")
    listed_a, listed_b = {f.id for f in a.files.list()}, {f.id for f in b.files.list()}
    assert mine.id in listed_a and theirs.id not in listed_a
    assert theirs.id in listed_b and mine.id not in listed_b
    # the owner still can, and the object shows no owner
    assert a.files.retrieve(mine.id).filename == "a.jsonl" and b"custom_id" in a.files.content(mine.id).content
    assert "owner" not in a.files.retrieve(mine.id).model_dump()
    assert a.files.delete(mine.id).deleted and b.files.delete(theirs.id).deleted
    with pytest.raises(openai.AuthenticationError):
        client_for(stack, "sk-unknown").files.list()


def test_a_batch_and_its_result_files_are_its_keys_only(a, b):
    file = a.files.create(file=("in.jsonl", batch_input("one", "two")), purpose="batch")
    batch = a.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id)):
        assert not_found(call)["code"] == "batch_not_found"
    assert batch.id in [x.id for x in a.batches.list(limit=100)]
    assert batch.id not in [x.id for x in b.batches.list(limit=100)]
    done = wait_for(lambda: (x := a.batches.retrieve(batch.id)).status in ("completed", "failed", "cancelled",
                                                                           "expired") and x, 180, "the batch")
    assert done.status == "completed" and done.request_counts.completed == 2, done
    output = done.output_file_id
    for call in (lambda: b.files.retrieve(output), lambda: b.files.content(output),
                 lambda: b.files.delete(output)):
        assert not_found(call)["code"] == "file_not_found"
    assert output not in {f.id for f in b.files.list()} and output in {f.id for f in a.files.list()}
    assert sorted(json.loads(l)["custom_id"] for l in a.files.content(output).text.splitlines()) == ["one", "two"]
    assert not_found(lambda: b.batches.cancel(batch.id))["code"] == "batch_not_found"
    with pytest.raises(openai.BadRequestError):
        a.batches.cancel(batch.id)  # A's own: found, and already completed


def test_a_stored_response_is_its_keys_only(a, b):
    first = a.responses.create(model=MODEL, input="My name is Ada. Say hello.", max_output_tokens=4, temperature=0)
    for call in (lambda: b.responses.retrieve(first.id), lambda: b.responses.input_items.list(first.id),
                 lambda: b.responses.delete(first.id), lambda: b.responses.cancel(first.id)):
        body = not_found(call)
        assert (body["code"], body["type"]) == ("response_not_found", "invalid_request_error")
    refused = not_found(lambda: b.responses.create(model=MODEL, input="What is my name?", max_output_tokens=2,
                                                   previous_response_id=first.id))
    assert (refused["code"], refused["param"]) == ("previous_response_not_found", "previous_response_id")
    running = a.responses.create(model=MODEL, input="Count to a thousand.", max_output_tokens=900, background=True,
                                 extra_body={"ignore_eos": True})
    assert not_found(lambda: b.responses.cancel(running.id))["code"] == "response_not_found"
    assert a.responses.retrieve(running.id).status in ("queued", "in_progress")
    assert a.responses.cancel(running.id).status == "cancelled"
    # A's conversation goes on, and A still reads and deletes its own
    second = a.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                max_output_tokens=2, temperature=0)
    assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
    assert a.responses.retrieve(first.id).output_text == first.output_text
    assert [i.type for i in a.responses.input_items.list(first.id).data] == ["message"]
    a.responses.delete(first.id)
    not_found(lambda: a.responses.retrieve(first.id))


def test_records_stored_without_an_owner_are_no_keys(stack, a):
    """A state dir from before owners were recorded: its records load, as the anonymous owner's,
    whom no API key is (a gateway without keys sees them all)."""
    file_id, response_id = f"file-legacy{uuid.uuid4().hex[:8]}", f"resp_legacy{uuid.uuid4().hex[:8]}"
    response = {"id": response_id, "object": "response", "status": "completed", "output": []}

    async def store_legacy() -> None:
        bus = await Bus.connect(stack.spec.nats_url, "test-legacy")
        try:
            subjects = Subjects(stack.spec.namespace)
            await (await FileStore.open(bus, subjects)).put(
                FileRecord(id=file_id, bytes=2, created_at=1, filename="old.jsonl", purpose="batch"), b"{}")
            await (await ResponseStore.open(bus, subjects, ttl_s=60.0)).create(StoredResponse(
                id=response_id, created_at=1, status="completed", response=json.dumps(response), input_items="[]"))
        finally:
            await bus.close()

    asyncio.run(store_legacy())
    assert not_found(lambda: a.files.retrieve(file_id))["code"] == "file_not_found"
    assert file_id not in {f.id for f in a.files.list()}
    assert not_found(lambda: a.responses.retrieve(response_id))["code"] == "response_not_found"


# --- background responses and admission's 429 -----------------------------------------------------
def decode_load(stack) -> dict:
    return next(((w["load"] or {}) for w in cluster_status(stack)["workers"] if w["info"]["role"] == "decode"), {})


@pytest.fixture(scope="module")
def rated(stack):
    """A prefill rate measured at admission (warm-up's is not kept): without one there is no
    prediction, and tight's requests are admitted."""
    if not decode_load(stack).get("prefill_tokens_per_s"):
        client_for(stack, KEYS["a"]).completions.create(model=MODEL, prompt="word " * 50, max_tokens=1)
    return stack


def long_standard_prompt(stack) -> None:
    """A ~900-token standard prompt (a fresh first block each time: nothing of it is cached):
    admission counts it among the higher tier's arrivals that a tight request would wait behind."""
    client_for(stack, KEYS["a"]).completions.create(
        model=MODEL, prompt=f"Request {uuid.uuid4().hex}: " + "word " * 900, max_tokens=1)


def miss_tight(stack) -> str:
    """One tight request right after a long standard one: it would meet its 20 ms alone (a few
    tokens), but standard prompts of ~900 tokens arrive above it, so it is predicted to miss (429),
    and admission sheds ``low`` for ``SHED_HOLD_S``."""
    long_standard_prompt(stack)
    with pytest.raises(openai.RateLimitError) as info:
        client_for(stack, KEYS["tight"]).completions.create(model=MODEL, prompt="hi", max_tokens=1)
    return info.value.body["code"]


def retries(stack, response_id: str) -> int:
    """The gateway's log lines of ``response_id`` waiting out one of admission's 429s."""
    return sum(f"{response_id}: 429 " in line and "; asking again" in line for line in list(stack.lines))


def finished(client: openai.OpenAI, response_id: str, timeout_s: float = 60.0):
    return wait_for(lambda: (r := client.responses.retrieve(response_id)).status in FINAL and r, timeout_s,
                    f"background response {response_id} to end")


def test_a_background_response_waits_out_a_429_and_then_runs(rated):
    stack = rated
    low = client_for(stack, KEYS["low"])
    assert miss_tight(stack) == "slo"
    started = time.monotonic()
    queued = low.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4, temperature=0,
                                  background=True)
    done = finished(low, queued.id)
    assert done.status in ("completed", "incomplete") and done.output_text, done
    assert retries(stack, queued.id) >= 1 and time.monotonic() - started >= SHED_HOLD_S - 1


def test_a_background_response_gives_up_after_the_wait_and_a_cancel_ends_its_wait(rated):
    stack = rated
    low = client_for(stack, KEYS["low"])
    stop, shedding = threading.Event(), threading.Event()

    def keep_shedding() -> None:  # a tight miss every second or so keeps low shed
        while not stop.is_set():
            try:
                miss_tight(stack)
                shedding.set()
            except (openai.APIError, pytest.fail.Exception):   # admitted after all: try again
                pass
            stop.wait(0.2)

    shedder = threading.Thread(target=keep_shedding, daemon=True)
    shedder.start()
    try:
        assert shedding.wait(60), "no tight request was rejected"
        started = time.monotonic()
        gives_up = low.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4, background=True)
        cancelled = low.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=4, background=True)
        wait_for(lambda: retries(stack, cancelled.id), 30, "the response to wait out a 429")
        assert low.responses.cancel(cancelled.id).status == "cancelled"
        failed = finished(low, gives_up.id)
        waited_s = time.monotonic() - started
    finally:
        stop.set()
        shedder.join(30)
    assert failed.status == "failed" and failed.error.code == "rate_limit_exceeded", failed
    # the last rejection, as admission worded it: shed for the tight misses, or, when the last try
    # fell between two shedding holds, low's own predicted miss (the shedder's long standard
    # prompts, a tier above, take the whole prefill rate: an infinite prediction)
    assert "tries in" in failed.error.message, failed.error
    assert "shed" in failed.error.message or "> low SLO" in failed.error.message, failed.error
    assert MAX_RETRY_WAIT_S - 1 <= waited_s <= MAX_RETRY_WAIT_S + 30
    seen = retries(stack, cancelled.id)
    time.sleep(SHED_HOLD_S + 1)  # no longer shed: a wait still going on would have asked again by now
    assert low.responses.retrieve(cancelled.id).status == "cancelled"
    assert retries(stack, cancelled.id) == seen
