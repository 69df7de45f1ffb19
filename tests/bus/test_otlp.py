"""Spans reach an OpenTelemetry collector over OTLP/HTTP, as `OTEL_EXPORTER_OTLP_ENDPOINT`
asks: a receiver written here (a loopback HTTP server decoding the protobuf export
request) gets the producer's span and the consumer's, in one trace, the consumer's
parented on and linked to the producer's."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from services.bus import Publisher, tracing
from services.bus.consume import Delivery, consume_durable

pytestmark = pytest.mark.timeout(60)


class Receiver(ThreadingHTTPServer):
    """Collects the spans of every `POST /v1/traces`, with the service that sent them."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[tuple[str, Span]] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            self.server.paths.append(self.path)
            for rs in req.resource_spans:
                service = next(
                    a.value.string_value for a in rs.resource.attributes if a.key == "service.name"
                )
                for ss in rs.scope_spans:
                    self.server.spans.extend((service, s) for s in ss.spans)
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    t = threading.Thread(target=r.serve_forever, daemon=True)
    t.start()
    try:
        yield r
    finally:
        r.shutdown()
        r.server_close()
        t.join(5)


async def test_spans_reach_a_collector_over_otlp_http(
    js, events, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llmgw-otlp-test")
    provider = tracing.setup_from_env("llmgw", set_global=False)
    assert provider is not None
    try:
        (e,) = events(1)
        await Publisher(js).publish(e)
        handled = asyncio.Event()

        async def handler(d: Delivery) -> None:
            handled.set()

        stop = asyncio.Event()
        task = asyncio.create_task(
            consume_durable(
                js,
                durable="otlp",
                filter_subject="llmgw.>",
                handler=handler,
                stop=stop,
                fetch_timeout_s=0.2,
            )
        )
        await asyncio.wait_for(handled.wait(), 10)
        stop.set()
        await asyncio.wait_for(task, 5)
    finally:
        provider.shutdown()  # flushes the batch to the receiver
        tracing.use_provider(None)
    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    assert {service for service, _ in receiver.spans} == {"llmgw-otlp-test"}
    by_kind = {s.kind: s for _, s in receiver.spans}
    producer = by_kind[Span.SpanKind.SPAN_KIND_PRODUCER]
    consumer = by_kind[Span.SpanKind.SPAN_KIND_CONSUMER]
    assert consumer.trace_id == producer.trace_id
    assert consumer.parent_span_id == producer.span_id
    assert [link.span_id for link in consumer.links] == [producer.span_id]
    attrs = {a.key: a.value.string_value for a in producer.attributes}
    assert attrs["messaging.message.id"] == e.id
