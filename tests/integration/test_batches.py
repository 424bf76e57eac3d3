"""The Batch API on a real stack and the real SmolLM2, through the official ``openai`` client:
``files.create`` → ``batches.create`` → polling → ``files.content``, every custom_id answered
exactly once and greedy lines equal to the same requests sent online; fewer lines at once beside
online requests; a decode worker killed mid-batch, then a gateway; cancel with partial results
kept; bad lines in the error file; a malformed file failing with its line named; 413 on a
too-large upload; a batch served by any gateway; ``/v1/responses`` lines continuing a stored response
of their own key only; a batch that outlives a restart of the whole stack on the same state dir."""

from __future__ import annotations

import io
import json
import threading
import time
import urllib.request
import uuid

import openai
import pytest

from services.stack.stack import StackSpec
from stack_helpers import running_stack, spawn_ready_decode, stack_spec, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
MAX_FILE_BYTES = 64 << 10
PROMPTS = ["The capital of France is", "Two plus two equals", "The colour of the sky is", "Water boils at",
           "The largest planet is", "A week has", "Cats like to", "The opposite of hot is"]


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    spec = stack_spec(tmp_path_factory.mktemp("stack"), "b", nats_server, redis_server, num_decode=1, num_gateways=2,
                      model=MODEL,
                      # a killed gateway's lines go to the other one after the ack wait
                      gateway_flags={"max_file_bytes": MAX_FILE_BYTES, "batch_max_in_flight": 4,
                                     "batch_ack_wait_s": 4, "batch_in_flight_beside_online": 1,
                                     "batch_online_quiet_s": 0.5},
                      decode_flags={"max_model_len": 512, "kv_cache_memory": "64MiB", "device": "cpu",
                                    "num_warmup_requests": 1})
    with running_stack(spec, ready_timeout_s=180) as s:
        yield s


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(stack):
    return client_of(stack.base_url)


def chat_line(custom_id: str, prompt: str, max_tokens: int = 8) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                     "max_tokens": max_tokens}}


def jsonl(lines: list) -> bytes:
    return b"".join((l if isinstance(l, str) else json.dumps(l)).encode() + b"\n" for l in lines)


def submit(client: openai.OpenAI, lines: list, endpoint: str = "/v1/chat/completions"):
    file = client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h",
                                 metadata={"test": "yes"})


def finished(client: openai.OpenAI, batch_id: str, timeout_s: float = 240.0):
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in
                    ("completed", "failed", "cancelled", "expired") and b, timeout_s, f"batch {batch_id} to finish")


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(l) for l in client.files.content(file_id).text.splitlines()]


def test_batch_answers_every_line_once_as_online(client, stack):
    lines = [chat_line(f"req-{i}", p) for i, p in enumerate(PROMPTS)]
    lines.append({"custom_id": "completion", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "temperature": 0,
                           "max_tokens": 4, "n": 2}})
    batch = submit(client, lines)
    assert (batch.status, batch.endpoint, batch.metadata) == ("validating", "/v1/chat/completions", {"test": "yes"})
    # any gateway answers for it: its state is in NATS
    assert client_of(stack.base_urls[1]).batches.retrieve(batch.id).id == batch.id
    done = finished(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (9, 9, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    output = read_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(l["custom_id"] for l in lines)
    by_id = {o["custom_id"]: o for o in output}
    for i, prompt in enumerate(PROMPTS):
        line = by_id[f"req-{i}"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["object"] == "chat.completion"
        online = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                temperature=0, max_tokens=8)
        assert line["response"]["body"]["choices"][0]["message"]["content"] == online.choices[0].message.content
    assert len(by_id["completion"]["response"]["body"]["choices"]) == 2
    assert batch.id in [b.id for b in client.batches.list(limit=100)]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_completions_batch_with_bad_lines_in_the_error_file(client):
    lines = [{"custom_id": "good", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": "Once upon a time", "temperature": 0, "max_tokens": 6}},
             {"custom_id": "unknown-param", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": "x", "no_such_parameter": 1}},
             {"custom_id": "streamed", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": "x", "stream": True}}]
    done = finished(client, submit(client, lines, "/v1/completions").id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 1, 2)
    online = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=6)
    [good] = read_lines(client, done.output_file_id)
    assert good["response"]["body"]["choices"][0]["text"] == online.choices[0].text
    errors = {e["custom_id"]: e["response"] for e in read_lines(client, done.error_file_id)}
    assert errors["unknown-param"]["status_code"] == 400
    assert errors["unknown-param"]["body"]["error"]["param"] == "no_such_parameter"
    assert errors["streamed"]["body"]["error"]["param"] == "stream"


def test_malformed_file_fails_naming_the_line(client):
    lines = [chat_line("a", "hi"), "{not json", {**chat_line("c", "hi"), "url": "/v1/completions"}]
    done = finished(client, submit(client, lines).id, timeout_s=30)
    assert done.status == "failed" and done.failed_at is not None
    assert [(e.code, e.line) for e in done.errors.data] == [("invalid_json_line", 2), ("mismatched_endpoint", 3)]


def test_too_large_upload_is_a_413(client):
    with pytest.raises(openai.APIStatusError) as err:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * (MAX_FILE_BYTES + 1))), purpose="batch")
    assert err.value.status_code == 413
    assert err.value.body["code"] == "file_too_large" and str(MAX_FILE_BYTES) in err.value.body["message"]


def test_files_list_retrieve_content_delete(client):
    data = jsonl([chat_line("a", "hi")])
    file = client.files.create(file=("mine.jsonl", io.BytesIO(data)), purpose="batch")
    assert (file.object, file.bytes, file.filename, file.purpose, file.id[:5]) == \
        ("file", len(data), "mine.jsonl", "batch", "file-")
    assert client.files.retrieve(file.id).bytes == len(data)
    assert client.files.content(file.id).content == data
    assert file.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", io.BytesIO(data)), purpose="fine-tune")


def batch_lines_running(url: str) -> int:
    with urllib.request.urlopen(url + "/status", timeout=10) as r:
        return json.load(r)["gateway"]["batch_lines_in_flight"]


def test_batch_lines_keep_to_the_limit_beside_online_requests_and_take_the_rest_after(client, stack):
    """Each gateway runs at most ``--batch-in-flight-beside-online`` (1 here) lines while it serves an
    online request, and its whole ``--batch-max-in-flight`` (4) once online traffic is quiet."""
    first_token = [threading.Event() for _ in stack.base_urls]
    online_done = threading.Event()

    def stream(i: int, url: str) -> None:
        chunks = client_of(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=48,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        for _ in chunks:
            first_token[i].set()

    threads = [threading.Thread(target=stream, args=(i, url), daemon=True) for i, url in enumerate(stack.base_urls)]
    for t in threads:
        t.start()
    for event in first_token:
        assert event.wait(120), "an online stream never started"
    watcher = threading.Thread(target=lambda: ([t.join() for t in threads], online_done.set()), daemon=True)
    watcher.start()
    batch = submit(client, [chat_line(f"o-{i}", f"{PROMPTS[i % 8]} (beside {i})", max_tokens=32) for i in range(32)])
    beside = []
    while not online_done.is_set():
        beside.append([batch_lines_running(url) for url in stack.base_urls])
        time.sleep(0.05)
    assert any(sum(s) for s in beside), "no line ran beside the online streams"
    assert max(max(s) for s in beside) <= 1, beside
    after = wait_for(lambda: max(n := [batch_lines_running(url) for url in stack.base_urls]) >= 2 and n, 60,
                     "more lines once online traffic went quiet")
    assert max(after) <= 4
    done = finished(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 32


def test_cancel_stops_the_batch_and_keeps_partial_results(client):
    lines = [chat_line(f"slow-{i}", f"Count slowly from {i}:", max_tokens=16) for i in range(12)]
    batch = submit(client, lines)
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 120, "a first result")
    cancelled_at = time.monotonic()
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = finished(client, batch.id, timeout_s=30)
    assert done.status == "cancelled" and time.monotonic() - cancelled_at < 15
    output = read_lines(client, done.output_file_id)
    assert 1 <= len(output) < 12 and done.request_counts.completed == len(output)
    assert len({o["custom_id"] for o in output}) == len(output)


def test_decode_worker_killed_mid_batch_still_answers_every_line_once(client, stack):
    child, worker_id = spawn_ready_decode(stack, "decode-extra")
    lines = [chat_line(f"k-{i}", f"{p} (take {i})", max_tokens=16) for i, p in enumerate(PROMPTS + PROMPTS[:2])]
    batch = submit(client, lines)
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 120, "two results")
    child.kill()
    done = finished(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == len(lines)
    output = read_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(l["custom_id"] for l in lines)
    assert all(o["response"]["status_code"] == 200 for o in output)


def test_gateway_killed_mid_batch_still_answers_every_line_once(client, stack):
    lines = [chat_line(f"g-{i}", f"{p} (again {i})", max_tokens=16) for i, p in enumerate(PROMPTS)]
    batch = submit(client, lines)
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 120, "a first result")
    stack.children["gateway-2"].kill()  # it runs lines too: those come back to gateway 1
    done = finished(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == len(lines)
    output = read_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(l["custom_id"] for l in lines)
    assert all(o["response"]["status_code"] == 200 for o in output)


def test_responses_lines_continue_previous_responses_of_their_own_key_only(stack):
    """A gateway with two API keys beside the stack's: a line may continue a response its batch's
    key stored online (it runs on any gateway, as its batch's owner), and another key's is that
    line's 404, the one online gives."""
    from services.stack.servers import free_port  # noqa: PLC0415

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stack.spawn("gateway-keys", "gateway", {"namespace": stack.spec.namespace, "nats_url": stack.nats_url,
                                            "model": MODEL, "port": port, "api_keys": "k1,k2"})
    wait_for(lambda: (s := stack.ready_status(url)) and s.get("num_ready_decode_workers"), 60, f"{url}/ready")
    alice, bob = (openai.OpenAI(base_url=url + "/v1", api_key=k, max_retries=0, timeout=120) for k in ("k1", "k2"))
    first = alice.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4, temperature=0)
    with pytest.raises(openai.NotFoundError) as online:
        bob.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id)

    def line(custom_id: str, **extra) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses",
                "body": {"model": MODEL, "input": "What is my name?", "max_output_tokens": 4, "temperature": 0,
                         **extra}}

    lines = [line("plain"), line("continued", previous_response_id=first.id)]
    done = finished(alice, submit(alice, lines, "/v1/responses").id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 2, 0), done
    by_id = {o["custom_id"]: o["response"]["body"] for o in read_lines(alice, done.output_file_id)}
    assert by_id["continued"]["previous_response_id"] == first.id
    # the earlier turn's input and output came first
    assert by_id["continued"]["usage"]["input_tokens"] > by_id["plain"]["usage"]["input_tokens"]
    done = finished(bob, submit(bob, [line("not-mine", previous_response_id=first.id)], "/v1/responses").id)
    assert (done.status, done.request_counts.failed) == ("completed", 1), done
    [error] = read_lines(bob, done.error_file_id)
    assert error["response"]["status_code"] == 404
    assert error["response"]["body"]["error"] == online.value.body, error


def test_a_batch_outlives_a_restart_of_the_whole_stack(tmp_path):
    """``tandem up``'s own nats-server keeps JetStream under the state dir: a batch stopped mid-way
    with the whole stack (gateways, workers, servers) goes on when a stack starts again on the same
    state dir, and every line is answered once."""
    spec = StackSpec(state_dir=tmp_path / "state", num_decode=1, model=MODEL, port=0,
                     namespace=f"r{uuid.uuid4().hex[:8]}",
                     gateway_flags={"batch_max_in_flight": 1, "batch_ack_wait_s": 4},
                     decode_flags={"max_model_len": 512, "kv_cache_memory": "64MiB", "device": "cpu",
                                   "num_warmup_requests": 1})
    lines = [chat_line(f"r-{i}", f"{p} (restart {i})", max_tokens=24) for i, p in enumerate(PROMPTS)]
    with running_stack(spec, ready_timeout_s=180) as first:
        client = client_of(first.base_url)
        batch = submit(client, lines)
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 120, "a first result")
    with running_stack(spec, ready_timeout_s=180) as again:
        client = client_of(again.base_url)
        assert client.batches.retrieve(batch.id).request_counts.completed < len(lines)  # stopped mid-way
        done = finished(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == len(lines)
        output = read_lines(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in output) == sorted(l["custom_id"] for l in lines)
        assert all(o["response"]["status_code"] == 200 for o in output)
