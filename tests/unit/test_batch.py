"""The pure parts of the Files and Batch APIs: input-line validation, the batch state machine and
its next step, output-file assembly, the objects as the official client parses them, and the wire
models' JSON round trip."""

from __future__ import annotations

import json

import openai.types
import pytest

from shared.openai_api.batch.lines import parse_input
from shared.openai_api.json_body import MAX_JSON_DEPTH
from shared.openai_api.batch.objects import batch_object, file_object, result_file_ids
from shared.openai_api.responses import page
from shared.openai_api.batch.output import assemble, line_id
from shared.openai_api.batch.state import InvalidTransition, can_cancel, next_step, transition
from shared.protocol import Subjects
from shared.protocol.batch import (BatchLineError, BatchLineRequest, BatchLineResult, BatchRecord, FileRecord,
                                   RequestCounts)

CHAT = "/v1/chat/completions"


def jsonl(*objs) -> bytes:
    return b"".join((o if isinstance(o, str) else json.dumps(o)).encode() + b"\n" for o in objs)


def line(custom_id: str, url: str = CHAT, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, **extra}


def deep_line(depth: int) -> str:
    """A line whose body is nested ``depth`` levels deep."""
    lists = "[" * (depth - 1) + "]" * (depth - 1)
    return f'{{"custom_id": "x", "method": "POST", "url": "{CHAT}", "body": {{"messages": {lists}}}}}'


# --- input lines ---------------------------------------------------------------------------------
def test_valid_file_gives_lines_in_order_with_one_based_numbers_and_skips_blank_lines():
    lines, errors = parse_input(jsonl(line("a"), "", line("b")), CHAT, max_line_bytes=4096)
    assert errors == []
    assert [(l.line, l.custom_id) for l in lines] == [(1, "a"), (3, "b")]
    assert json.loads(lines[0].body)["max_tokens"] == 4


@pytest.mark.parametrize("bad, code, param", [
    ("{not json", "invalid_json_line", None),
    ("[1, 2]", "invalid_json_line", None),
    ({"method": "POST", "url": CHAT, "body": {}}, "missing_required_parameter", "custom_id"),
    ({**line("x"), "method": "GET"}, "invalid_method", "method"),
    (line("x", url="/v1/completions"), "mismatched_endpoint", "url"),
    ({**line("x"), "body": "text"}, "missing_required_parameter", "body"),
])
def test_a_malformed_line_fails_the_file_naming_its_line(bad, code, param):
    lines, errors = parse_input(jsonl(line("a"), bad, line("c")), CHAT, max_line_bytes=4096)
    assert lines == []
    assert [(e.code, e.line, e.param) for e in errors] == [(code, 2, param)]
    assert errors[0].message.startswith("line 2: ")


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"²": 5}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"9" * 5000: 5}}, "logit_bias"),
    ({"messages": json.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)}, None),  # invalid_json: no param
])
async def test_a_line_the_endpoint_refuses_is_a_400_result_not_a_failure(body, param):
    """``execute`` turns the refusal into the line's result (its error file row), so the batch
    completes instead of retrying the line to its last delivery."""
    from services.gateway.batch_runner import execute  # noqa: PLC0415

    class Gateway:  # the parse refuses before any of the gateway is used
        tokenizer = None

        def generate_request(self, *args):
            raise AssertionError("the line should have been refused before")

    request = BatchLineRequest(batch_id="batch_1", line=1, custom_id="a", url=CHAT, body=json.dumps(body))
    outcome = await execute(Gateway(), request, tier="default", priority=9)
    assert outcome.status == 400 and outcome.body["error"]["type"] == "invalid_request_error"
    assert param is None or outcome.body["error"]["param"] == param


# nested past MAX_JSON_DEPTH, and past what Python's json can parse at all (once a RecursionError
# that left the batch unvalidated)
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 10_000])
def test_a_line_nested_too_deep_fails_the_file_naming_its_line(depth):
    lines, errors = parse_input(jsonl(line("a"), deep_line(depth)), CHAT, max_line_bytes=64 << 10)
    assert lines == [] and [(e.code, e.line, e.param) for e in errors] == [("invalid_json_line", 2, "body")]
    assert parse_input(jsonl(deep_line(MAX_JSON_DEPTH)), CHAT, max_line_bytes=4096)[1] == []


def test_duplicate_custom_id_names_both_lines():
    _, errors = parse_input(jsonl(line("a"), line("b"), line("a")), CHAT, max_line_bytes=4096)
    assert [(e.code, e.line) for e in errors] == [("duplicate_custom_id", 3)]
    assert "line 1" in errors[0].message


def test_empty_file_non_utf8_and_long_lines_are_refused():
    assert parse_input(b"\n\n", CHAT, max_line_bytes=4096)[1][0].code == "empty_file"
    assert parse_input(b"\xff\xfe", CHAT, max_line_bytes=4096)[1][0].code == "invalid_file"
    _, errors = parse_input(jsonl(line("a", pad="x" * 200)), CHAT, max_line_bytes=100)
    assert (errors[0].code, errors[0].line) == ("line_too_large", 1)


# --- the state machine -----------------------------------------------------------------------------
def record(**changes) -> BatchRecord:
    base = BatchRecord(id="batch_1", endpoint=CHAT, input_file_id="file-1", created_at=100, expires_at=100 + 86400)
    return base.model_copy(update=changes)


def test_transitions_follow_openais_lifecycle_and_stamp_their_time():
    running = transition(record(), "in_progress", 101.5, request_counts=RequestCounts(total=3))
    assert (running.status, running.in_progress_at, running.request_counts.total) == ("in_progress", 101, 3)
    done = transition(transition(running, "finalizing", 110), "completed", 111)
    assert (done.finalizing_at, done.completed_at) == (110, 111)
    assert transition(running, "cancelling", 105).cancelling_at == 105
    for status, to in [("validating", "completed"), ("completed", "cancelling"), ("cancelled", "in_progress"),
                       ("failed", "in_progress"), ("cancelling", "completed")]:
        with pytest.raises(InvalidTransition, match=f"from {status} to {to}"):
            transition(record(status=status), to, 1)


def test_only_validating_and_running_batches_can_be_cancelled():
    assert [s for s in ("validating", "in_progress", "finalizing", "completed", "cancelling", "failed")
            if can_cancel(record(status=s))] == ["validating", "in_progress"]


def steps(rec: BatchRecord, num_results: int, now: float):
    step = next_step(rec, num_results, now, claim_stale_s=60, cancel_grace_s=2)
    return None if step is None else step.kind


def test_next_step():
    counts = RequestCounts(total=3)
    assert steps(record(), 0, 100) == "validate"
    assert steps(record(claimed_at=90.0), 0, 100) is None          # someone is validating it
    assert steps(record(claimed_at=30.0), 0, 100) == "validate"    # ... and died: take it over
    running = record(status="in_progress", request_counts=counts)
    assert steps(running, 2, 200) is None
    assert steps(running, 3, 200) == "finalize"
    assert steps(running, 2, 100 + 86400) == "expire"
    assert steps(record(status="finalizing", claimed_at=10.0), 3, 200) == "finalize"
    cancelling = record(status="cancelling", cancelling_at=200, request_counts=counts)
    assert steps(cancelling, 1, 201) is None                        # running lines may still finish
    assert steps(cancelling, 1, 202) == "finish_cancel"
    for status in ("completed", "failed", "expired", "cancelled"):
        assert steps(record(status=status), 0, 10**9) is None


# --- output files ----------------------------------------------------------------------------------
def result(n: int, status: int | None = 200, **changes) -> BatchLineResult:
    body = json.dumps({"id": f"chatcmpl-{n}", "choices": []} if status == 200 else {"error": {"message": "no"}})
    return BatchLineResult(batch_id="batch_1", line=n, custom_id=f"c{n}", request_id=f"chatcmpl-{n}",
                           status_code=status, body=body).model_copy(update=changes)


def test_assembly_orders_by_line_and_splits_successes_from_errors():
    files = assemble("batch_1", [result(3), result(1), result(2, 400)], 3)
    out = [json.loads(l) for l in files.output.splitlines()]
    err = [json.loads(l) for l in files.errors.splitlines()]
    assert [o["custom_id"] for o in out] == ["c1", "c3"]
    assert out[0] == {"id": line_id("batch_1", "c1"), "custom_id": "c1", "error": None,
                      "response": {"status_code": 200, "request_id": "chatcmpl-1",
                                   "body": {"id": "chatcmpl-1", "choices": []}}}
    assert err[0]["response"]["status_code"] == 400 and err[0]["response"]["body"]["error"]["message"] == "no"
    assert files.counts == RequestCounts(total=3, completed=2, failed=1)


def test_expired_lines_go_to_the_error_file_as_batch_expired():
    files = assemble("batch_1", [result(1)], 3, expired=[(2, "c2"), (3, "c3")])
    err = [json.loads(l) for l in files.errors.splitlines()]
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in err] == \
        [("c2", None, "batch_expired"), ("c3", None, "batch_expired")]
    assert files.counts == RequestCounts(total=3, completed=1, failed=2)
    assert assemble("batch_1", [], 0).output == b""


# --- objects as the official client reads them ---------------------------------------------------
def test_file_and_batch_objects_parse_as_the_openai_types():
    file = openai.types.FileObject.model_validate(file_object(FileRecord(
        id="file-1", bytes=10, created_at=5, filename="in.jsonl", purpose="batch")))
    assert (file.id, file.object, file.bytes, file.status) == ("file-1", "file", 10, "processed")
    # the owner says who may see it: not part of OpenAI's objects
    assert "owner" not in file_object(FileRecord(id="f", bytes=1, created_at=1, filename="f", purpose="batch",
                                                 owner="key_1"))
    assert "owner" not in batch_object(record(owner="key_1"))
    failed = transition(record(), "failed", 101, errors=[BatchLineError(code="invalid_json_line", line=2,
                                                                         message="line 2: not valid JSON")])
    batch = openai.types.Batch.model_validate(batch_object(failed))
    assert (batch.status, batch.failed_at, batch.errors.data[0].line) == ("failed", 101, 2)
    assert "claimed_at" not in batch_object(failed)
    running = openai.types.Batch.model_validate(batch_object(record(metadata={"k": "v"})))
    assert running.errors is None and running.metadata == {"k": "v"}


def test_page_and_result_file_ids():
    objs = [{"id": str(i)} for i in range(5)]
    assert page(objs, limit=2, after=None) == {"object": "list", "data": objs[:2], "first_id": "0",
                                               "last_id": "1", "has_more": True}
    assert page(objs, limit=2, after="3")["data"] == [{"id": "4"}]
    output_id, error_id = result_file_ids("batch_abc")
    assert (output_id, error_id) == ("file-abc-output", "file-abc-errors")


def test_wire_models_round_trip_and_result_keys_fit_kv():
    # a record stored before owners were recorded reads as the anonymous owner's
    legacy = json.loads(record().to_bytes())
    del legacy["owner"]
    assert BatchRecord.from_bytes(json.dumps(legacy).encode()).owner is None
    for message in (record(owner="key_1"),
                    BatchLineRequest(batch_id="batch_1", line=1, custom_id="c", url=CHAT, body="{}"),
                    result(1), FileRecord(id="file-1", bytes=1, created_at=1, filename="f", purpose="batch")):
        assert type(message).from_bytes(message.to_bytes()) == message
    key = Subjects.batch_result_key("batch_1", "any text: spaces, dots. and ünïcode")
    assert key.startswith("r.batch_1.") and all(c.isalnum() or c in "._" for c in key)
    assert Subjects("ns").batch_lines("batch_1").subject == "ns.v1.batch.lines.batch_1"


# --- the runner's line limit ---------------------------------------------------------------------

def test_line_limit_keeps_to_the_beside_online_limit_while_online_requests_run_or_just_ran():
    from services.gateway.batch_runner import RunnerConfig, line_limit

    config = RunnerConfig(max_in_flight=32, ack_wait_s=30, max_deliver=3, in_flight_beside_online=4,
                          online_quiet_s=2.0)
    assert line_limit(config, online_in_flight=0, since_online_s=float("inf")) == 32
    assert line_limit(config, online_in_flight=1, since_online_s=float("inf")) == 4
    assert line_limit(config, online_in_flight=0, since_online_s=1.9) == 4
    assert line_limit(config, online_in_flight=0, since_online_s=2.1) == 32
    # never above max_in_flight
    small = RunnerConfig(max_in_flight=2, ack_wait_s=30, max_deliver=3, in_flight_beside_online=4,
                         online_quiet_s=2.0)
    assert line_limit(small, online_in_flight=3, since_online_s=0.0) == 2


def test_the_runner_starts_no_line_above_the_limit_and_takes_the_whole_limit_when_online_goes_quiet():
    import asyncio
    import time
    from types import SimpleNamespace

    from services.gateway.batch_runner import BatchRunner, RunnerConfig
    from services.gateway.metrics import GatewayMetrics
    from shared.policy.qos import load_qos

    class Queue:
        def __init__(self, n):
            self.left = n

        async def fetch(self, n, timeout_s):
            take = min(n, self.left)
            self.left -= take
            if not take:
                await asyncio.sleep(timeout_s)
            return [SimpleNamespace(payload=SimpleNamespace(batch_id="b")) for _ in range(take)]

        async def close(self):
            pass

    class Store:
        async def line_consumer(self, **_):
            return queue

    async def scenario():
        metrics = GatewayMetrics()
        metrics.num_in_flight = 1  # an online request runs
        gateway = SimpleNamespace(metrics=metrics, qos=load_qos(None))
        runner = BatchRunner(gateway, Store(), RunnerConfig(max_in_flight=6, ack_wait_s=30, max_deliver=3,
                                                            in_flight_beside_online=2, online_quiet_s=0.3))
        running, peak, release = set(), [0], asyncio.Event()
        checks_at_limit, held_back, all_running = [0], asyncio.Event(), asyncio.Event()

        async def settle(message):
            running.add(id(message))
            peak[0] = max(peak[0], len(running))
            if len(running) == 6:
                all_running.set()
            await release.wait()
            running.discard(id(message))

        def limit():
            value = type(runner)._limit(runner)
            if len(running) >= value:
                checks_at_limit[0] += 1
                if checks_at_limit[0] >= 3:  # it looked again (and again) and started nothing more
                    held_back.set()
            return value

        runner._settle, runner._limit = settle, limit
        task = asyncio.create_task(runner.run_forever())
        await asyncio.wait_for(held_back.wait(), 10)
        beside = peak[0]
        assert metrics.num_batch_lines == beside  # what /status and /metrics show
        metrics.num_in_flight, metrics.online_ended_at = 0, time.monotonic() - 1.0  # quiet for 1 s > 0.3 s
        await asyncio.wait_for(all_running.wait(), 10)
        quiet = peak[0]
        assert metrics.num_batch_lines == quiet
        release.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return beside, quiet

    queue = Queue(20)
    assert asyncio.run(scenario()) == (2, 6)


def test_lines_a_fetch_brings_after_online_traffic_began_start_against_the_new_limit():
    """A fetch issued while the gateway was quiet asks for the whole limit; when an online request
    begins while it waits, the lines it brings start only up to the limit beside online, and the
    rest are held (their ack wait renewed) until there is room."""
    import asyncio
    from types import SimpleNamespace

    from services.gateway.batch_runner import BatchRunner, RunnerConfig
    from services.gateway.metrics import GatewayMetrics
    from shared.policy.qos import load_qos

    metrics = GatewayMetrics()

    class Queue:
        def __init__(self):
            self.asked: list[int] = []

        async def fetch(self, n, timeout_s):
            self.asked.append(n)
            if len(self.asked) > 1:
                await asyncio.sleep(timeout_s)
                return []
            metrics.observe_started()  # online traffic begins while the fetch waits
            return [SimpleNamespace(payload=SimpleNamespace(batch_id="b"), in_progress=lambda: None)
                    for _ in range(n)]

        async def close(self):
            pass

    queue = Queue()

    class Store:
        async def line_consumer(self, **_):
            return queue

    async def scenario():
        runner = BatchRunner(SimpleNamespace(metrics=metrics, qos=load_qos(None)), Store(),
                             RunnerConfig(max_in_flight=6, ack_wait_s=30, max_deliver=3, in_flight_beside_online=2,
                                          online_quiet_s=60))
        started, release = asyncio.Event(), asyncio.Event()

        async def settle(message):
            if len(runner._tasks) == 2:
                started.set()
            await release.wait()

        runner._settle = settle
        task = asyncio.create_task(runner.run_forever())
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.sleep(0.6)  # two more looks at the limit: nothing more starts
        running, held = metrics.num_batch_lines, len(runner._held)
        release.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return queue.asked[0], running, held

    assert asyncio.run(scenario()) == (6, 2, 4)


async def test_a_responses_line_continues_its_previous_response_as_its_batch_owner():
    """``previous_response_id`` in a batch line: the earlier turns come first, read as the batch's
    owner; the history's refusal (another key's response: online's 404) is the line's result, and
    a gateway that keeps no stored responses refuses the line rather than ignore the field."""
    from services.gateway.batch_runner import execute  # noqa: PLC0415
    from shared.openai_api.errors import ApiError  # noqa: PLC0415

    earlier = [{"type": "message", "role": "user", "content": "My name is Ada."}]

    async def history(previous_id: str, owner: str | None) -> list[dict]:
        if (previous_id, owner) != ("resp_1", "key_alice"):
            raise ApiError(404, f"Previous response with id {previous_id!r} not found.", param="previous_response_id",
                           code="previous_response_not_found", error_type="invalid_request_error")
        return earlier

    class Gateway:
        tokenizer = None

        async def prepared_request(self, api, tier):
            self.input = api.body.input
            raise ApiError(400, "stop here: the request as it would run is known")

    body = json.dumps({"model": "m", "input": "What is my name?", "previous_response_id": "resp_1"})
    request = BatchLineRequest(batch_id="batch_1", line=1, custom_id="a", url="/v1/responses", body=body)
    gateway = Gateway()
    await execute(gateway, request, tier="default", priority=9, owner="key_alice", history=history)
    assert [item.content for item in gateway.input] == ["My name is Ada.", "What is my name?"]
    outcome = await execute(Gateway(), request, tier="default", priority=9, owner="key_bob", history=history)
    assert (outcome.status, outcome.body["error"]["code"]) == (404, "previous_response_not_found")
    outcome = await execute(Gateway(), request, tier="default", priority=9, owner="key_alice", history=None)
    assert (outcome.status, outcome.body["error"]["param"]) == (400, "previous_response_id")
