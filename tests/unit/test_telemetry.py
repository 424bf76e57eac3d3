"""Tracing configuration, the TTFT phases and their Server-Timing header, JSON log lines, and the
wire fields that carry phases (backward compatible)."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from shared.protocol import PrefillNotification, TokenChunk
from shared.telemetry.logs import JsonFormatter, bind_request_id
from shared.telemetry.phases import (TOTAL, RemoteTimes, parse_server_timing, server_timing,
                                     worker_phases)
from shared.telemetry.tracing import service_name, wants_tracing


@pytest.mark.parametrize("env, wanted", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
])
def test_tracing_is_on_only_when_the_otel_variables_ask(env, wanted):
    assert wants_tracing(env) is wanted


def test_each_service_has_its_own_name_under_the_common_prefix():
    assert service_name("gateway", {}) == "tandem-gateway"
    assert service_name("kv-index", {"OTEL_SERVICE_NAME": "prod"}) == "prod-kv-index"


def test_local_phases_partition_the_workers_time():
    phases = worker_phases(10.0, 10.5, scheduled_at=10.2)
    assert phases == pytest.approx({"queue": 0.2, "prefill": 0.3})


def test_remote_phases_partition_the_workers_time_and_clamp_the_prefill_workers_report():
    times = RemoteTimes(published_at=10.1, delivered_at=10.9, queue_wait_s=0.3, prefill_s=0.4)
    phases = worker_phases(10.0, 11.0, remote=times)
    assert phases == pytest.approx({"queue": 0.1, "prefill_queue": 0.3, "prefill": 0.4, "transfer": 0.1,
                                    "first_step": 0.1})
    # a prefill worker whose clock runs ahead cannot claim more than the decode worker waited
    skewed = worker_phases(10.0, 11.0, remote=RemoteTimes(10.1, 10.9, queue_wait_s=5.0, prefill_s=0.4))
    assert sum(skewed.values()) == pytest.approx(1.0) and min(skewed.values()) >= 0


def test_server_timing_round_trips_in_milliseconds():
    value = server_timing({"gateway": 0.0012, "prefill": 0.25}, 0.3)
    assert value == "gateway;dur=1.200, prefill;dur=250.000, total;dur=300.000"
    assert parse_server_timing(value) == pytest.approx({"gateway": 0.0012, "prefill": 0.25, TOTAL: 0.3})
    assert parse_server_timing('cache;desc="hit", db;dur=53') == pytest.approx({"db": 0.053})


def test_json_lines_carry_the_request_and_trace_ids():
    formatter = JsonFormatter("decode")
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "prefilling %d tokens", (12,), None)
    assert "request_id" not in json.loads(formatter.format(record))
    ctx = SpanContext(trace_id=0xABC, span_id=0x1, is_remote=False, trace_flags=TraceFlags(1))
    bind_request_id("chatcmpl-1")
    try:
        with trace.use_span(NonRecordingSpan(ctx)):
            line = json.loads(formatter.format(record))
    finally:
        bind_request_id(None)
    assert line["request_id"] == "chatcmpl-1" and line["trace_id"] == f"{0xABC:032x}"
    assert line["message"] == "prefilling 12 tokens" and line["service"] == "decode"


def test_phase_fields_are_optional_on_the_wire():
    chunk = TokenChunk(request_id="r", index=0, token_ids=[1], phases={"queue": 0.01, "prefill": 0.2})
    assert TokenChunk.from_bytes(chunk.to_bytes()) == chunk
    assert TokenChunk.from_bytes(b'{"request_id": "r", "index": 1}').phases is None  # an older worker
    note = PrefillNotification(transfer_id="t", request_id="r", queue_wait_s=0.1, prefill_s=0.2)
    assert PrefillNotification.from_bytes(note.to_bytes()) == note
    assert PrefillNotification.from_bytes(b'{"transfer_id": "t", "request_id": "r"}').prefill_s is None


@pytest.mark.parametrize("protocol, module", [
    ("http/protobuf", "opentelemetry.exporter.otlp.proto.http.trace_exporter"),
    ("grpc", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"),
])
def test_the_otlp_protocol_picks_the_official_exporter(protocol, module):
    from shared.telemetry.tracing import _exporter

    exporter = _exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": protocol})
    assert type(exporter).__module__ == module
    exporter.shutdown()
    with pytest.raises(ValueError, match="http/json"):
        _exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
