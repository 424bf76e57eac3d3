"""Observability end to end on a real stack (gateway, admission, kv-index, one decode and one
prefill worker, the real SmolLM2) exporting its spans over OTLP/HTTP to a real receiver:

- one request is one trace, from the client's ``traceparent`` through every service, with each
  span's parent the span that sent its message (remote prefill included);
- the ``Server-Timing`` phases of a streamed response sum to its TTFT (``total``) within 5%;
- JSON log lines about a request carry its ``request_id`` and ``trace_id``.

Short prompts prefill locally, long ones go to the prefill worker (``max_local_prefill_tokens``).
"""

from __future__ import annotations

import http.client
import json
import platform
import secrets
import uuid

import pytest

from shared.telemetry.phases import TOTAL, parse_server_timing
from otlp_receiver import OtlpReceiver, ReceivedSpan
from stack_helpers import running_stack, stack_spec, wait_for

if platform.system() != "Linux":
    pytest.skip("remote prefill needs NIXL (nixl-cu12), a dependency on Linux only", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
ENGINE = {"max_model_len": 2048, "kv_cache_memory": "160MiB", "device": "cpu", "num_warmup_requests": 1}
MAX_LOCAL_PREFILL = 64
SPAN_TIMEOUT_S = 60.0
SERVING = {"tandem-gateway", "tandem-admission", "tandem-kv-index", "tandem-decode", "tandem-prefill"}
SERVER = 2  # OTLP SpanKind
CONSUMER = 5


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, receiver, tmp_path_factory):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_BSP_SCHEDULE_DELAY": "100", "TANDEM_LOG_FORMAT": "json"}
    spec = stack_spec(tmp_path_factory.mktemp("tracing"), "t", nats_server, redis_server, num_decode=1, num_prefill=1,
                      model=MODEL, registry_ttl_s=3.0,
                      decode_flags={**ENGINE, "max_local_prefill_tokens": MAX_LOCAL_PREFILL},
                      prefill_flags=ENGINE)
    with pytest.MonkeyPatch.context() as mp:  # the children inherit this process's environment
        for key, value in env.items():
            mp.setenv(key, value)
        with running_stack(spec, ready_timeout_s=240) as s:
            yield s


def stream_chat(stack, content: str, traceparent: str) -> tuple[dict[str, str], str]:
    """A streamed chat completion: the response headers (as sent before the first event) and body."""
    host, port = stack.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=180)
    body = {"model": MODEL, "stream": True, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json", "traceparent": traceparent})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:500]
    headers = {k.lower(): v for k, v in resp.getheaders()}
    text = resp.read().decode()
    conn.close()
    return headers, text


def client_trace() -> tuple[str, str, str]:
    """A trace id and span id as a client's tracer would make them, and the ``traceparent``."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def one(spans: list[ReceivedSpan], service: str, suffix: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name.endswith(suffix)]
    assert len(found) == 1, f"{len(found)} spans {service}/*{suffix} in {[(s.service, s.name) for s in spans]}"
    return found[0]


def assert_child(child: ReceivedSpan, parent: ReceivedSpan) -> None:
    assert child.parent_span_id == parent.span_id, (
        f"{child.service}/{child.name}: parent {child.parent_span_id}, expected {parent.service}/{parent.name} "
        f"({parent.span_id})")


def assert_connected(spans: list[ReceivedSpan], client_span_id: str) -> None:
    """Every span's parent is in the trace, except the gateway's, whose parent is the client's;
    and only the services that served the request are in it (no load reports, no autoscaler)."""
    ids = {s.span_id for s in spans}
    orphans = [(s.service, s.name) for s in spans if s.parent_span_id not in ids | {client_span_id}]
    assert not orphans, f"spans whose parent is not in the trace: {orphans}"
    strangers = [(s.service, s.name) for s in spans if s.service not in SERVING or ".load." in s.name]
    assert not strangers, f"spans that are not part of the request: {strangers}"


def assert_phases_sum_to_ttft(headers: dict[str, str], expected: set[str]) -> dict[str, float]:
    assert "server-timing" in headers, f"no Server-Timing header in {sorted(headers)}"
    timing = parse_server_timing(headers["server-timing"])
    total = timing.pop(TOTAL)
    assert set(timing) == expected, f"phases {sorted(timing)}, expected {sorted(expected)}"
    assert all(v >= 0 for v in timing.values()), timing
    summed = sum(timing.values())
    assert abs(summed - total) <= 0.05 * total, (
        f"phases sum to {summed * 1000:.2f} ms, TTFT {total * 1000:.2f} ms: {timing}")
    # consecutive intervals of the TTFT: a phase counted twice shows as a sum above it (the header
    # rounds each to a microsecond); the bus hops are a phase of their own, so nothing is left out
    assert summed <= total + 1e-5, f"phases sum to {summed * 1000:.3f} ms > TTFT {total * 1000:.3f} ms: {timing}"
    return timing


def json_lines(stack, service_prefix: str, request_id: str) -> list[dict]:
    out = []
    for line in stack.lines:
        name, _, text = line.partition("| ")
        if not name.strip().startswith(service_prefix) or not text.startswith("{"):
            continue
        record = json.loads(text)
        if record.get("request_id") == request_id:
            out.append(record)
    return out


def test_local_prefill_is_one_trace_with_its_phases(stack, receiver):
    trace_id, client_span_id, traceparent = client_trace()
    headers, body = stream_chat(stack, f"Say hello ({uuid.uuid4().hex[:6]}).", traceparent)
    assert "data: [DONE]" in body

    spans = receiver.wait_for_trace(trace_id, {
        ("tandem-gateway", "/v1/chat/completions"), ("tandem-gateway", "admission.submit request"),
        ("tandem-admission", "admission.submit process"), ("tandem-admission", "kvindex.match request"),
        ("tandem-kv-index", "kvindex.match process"), ("tandem-decode", ".generate process"),
        ("tandem-decode", "decode.queue"), ("tandem-decode", "decode.prefill")}, SPAN_TIMEOUT_S)
    http_span = one(spans, "tandem-gateway", "/v1/chat/completions")
    assert http_span.parent_span_id == client_span_id and http_span.kind == SERVER
    submit = one(spans, "tandem-gateway", "admission.submit request")
    assert_child(submit, http_span)
    admission = one(spans, "tandem-admission", "admission.submit process")
    assert_child(admission, submit)
    match = one(spans, "tandem-admission", "kvindex.match request")
    assert_child(match, admission)
    assert_child(one(spans, "tandem-kv-index", "kvindex.match process"), match)
    generate = one(spans, "tandem-decode", ".generate process")
    assert_child(generate, http_span)
    for name in ("decode.queue", "decode.prefill"):
        assert_child(one(spans, "tandem-decode", name), generate)
    assert_connected(spans, client_span_id)
    assert_phases_sum_to_ttft(headers, {"gateway", "admission", "queue", "prefill", "bus"})


def test_remote_prefill_joins_the_trace(stack, receiver):
    trace_id, client_span_id, traceparent = client_trace()
    long_prompt = f"[{uuid.uuid4().hex}] " + "Prefill workers write the KV cache of long prompts. " * 30
    headers, body = stream_chat(stack, long_prompt, traceparent)
    assert "data: [DONE]" in body

    spans = receiver.wait_for_trace(trace_id, {
        ("tandem-gateway", "/v1/chat/completions"), ("tandem-decode", ".generate process"),
        ("tandem-decode", "publish"), ("tandem-prefill", "prefill"), ("tandem-prefill", "prefill_queue.wait"),
        ("tandem-prefill", "prefill.compute"), ("tandem-prefill", "kv.write"), ("tandem-decode", "decode.transfer"),
        ("tandem-decode", "decode.first_step")}, SPAN_TIMEOUT_S)
    generate = one(spans, "tandem-decode", ".generate process")
    publish = one(spans, "tandem-decode", "publish")
    assert_child(publish, generate)
    prefill = one(spans, "tandem-prefill", "prefill")
    assert prefill.kind == CONSUMER
    assert_child(prefill, publish)
    for name in ("prefill_queue.wait", "prefill.compute", "kv.write"):
        assert_child(one(spans, "tandem-prefill", name), prefill)
    assert_connected(spans, client_span_id)
    phases = assert_phases_sum_to_ttft(
        headers, {"gateway", "admission", "queue", "prefill_queue", "prefill", "transfer", "first_step", "bus"})
    assert phases["prefill"] > 0, phases


def test_json_log_lines_carry_request_and_trace_ids(stack, receiver):
    trace_id, _, traceparent = client_trace()
    long_prompt = f"[{uuid.uuid4().hex}] " + "Every log line about a request names it. " * 30
    headers, _ = stream_chat(stack, long_prompt, traceparent)
    request_id = headers["x-request-id"]
    for service in ("gateway", "decode", "prefill"):
        lines = wait_for(lambda: json_lines(stack, service, request_id), 30, f"{service} log lines of {request_id}")
        assert all(r.get("trace_id") == trace_id for r in lines), (service, lines)
