"""A real OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with an
``ExportTraceServiceRequest`` (protobuf, optionally gzip), decoded with the official
``opentelemetry-proto`` messages; the spans are kept as ``ReceivedSpan``s."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                        ExportTraceServiceResponse)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str       # 32 hex digits
    span_id: str        # 16 hex digits
    parent_span_id: str  # "" for a root span
    kind: int
    start_ns: int
    end_ns: int


def decode_spans(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(ReceivedSpan(attrs.get("service.name", ""), s.name, s.trace_id.hex(), s.span_id.hex(),
                                          s.parent_span_id.hex(), s.kind, s.start_time_unix_nano,
                                          s.end_time_unix_nano))
    return spans


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.num_requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 — http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                spans = decode_spans(body)
                with receiver._lock:
                    receiver.spans.extend(spans)
                    receiver.num_requests += 1
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "OtlpReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for_trace(self, trace_id: str, names: set[tuple[str, str]], timeout_s: float) -> list[ReceivedSpan]:
        """The trace's spans once it holds every (service, name suffix) of ``names``; fails naming
        the missing ones at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            missing = {(svc, n) for svc, n in names if not any(s.service == svc and s.name.endswith(n) for s in spans)}
            if not missing:
                return spans
            if time.monotonic() > deadline:
                got = sorted((s.service, s.name) for s in spans)
                raise AssertionError(f"trace {trace_id}: after {timeout_s:g}s still no span {sorted(missing)}; "
                                     f"got {got}")
            time.sleep(0.05)
