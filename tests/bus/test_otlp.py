"""Spans reach an OpenTelemetry collector over OTLP/HTTP, as `OTEL_EXPORTER_OTLP_ENDPOINT`
asks: a receiver written here (a loopback HTTP server decoding the protobuf export
request) gets the producer's span and the consumer's, in one trace, the consumer's
parented on and linked to the producer's."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from services.bus import Publisher, tracing
from services.bus.consume import Delivery, consume_durable
from tests.otlp import Receiver, receiver

pytestmark = pytest.mark.timeout(60)

__all__ = ["receiver"]


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
