"""An OTLP/HTTP trace receiver in the test's process: what workers export
over ``OTEL_EXPORTER_OTLP_ENDPOINT``, decoded with OpenTelemetry's protobuf
package and kept as plain spans."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.waiting import wait_until


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    attributes: dict[str, Any]
    events: tuple[str, ...]
    service: str | None


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one OTLP/HTTP protobuf export."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    found = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                found.append(ReceivedSpan(
                    span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                    span.name, {a.key: _value(a.value) for a in span.attributes},
                    tuple(e.name for e in span.events), resource.get("service.name")))
    return found


@dataclass
class Receiver:
    """The spans received so far, and the endpoint to send them to."""

    endpoint: str
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def received(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, what: str, found: Callable[[list[ReceivedSpan]], bool],
                 timeout: float = 60) -> list[ReceivedSpan]:
        """Wait until the spans received satisfy ``found``; them."""
        return wait_until(self.received, f"{what} among the spans received", timeout,
                          until=found, every=0.05)


def serve() -> Iterator[Receiver]:
    """Serve OTLP/HTTP on a free port of 127.0.0.1 until the generator closes."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            spans = decode(body)
            with receiver.lock:
                receiver.spans.extend(spans)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = Receiver(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
