"""Publishing: ids make retries harmless; trace context travels with the message."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from schemas import codec, subjects
from services.bus import Publisher, PublishError, ensure_stream, follow, tracing
from services.bus.consume import Delivery, consume_durable, decode_checked


async def test_the_same_event_published_twice_is_stored_once(js, events):
    pub = Publisher(js)
    (e,) = events(1)
    first = await pub.publish(e)
    again = await pub.publish(e)
    assert (first.duplicate, again.duplicate) == (False, True)
    assert again.seq == first.seq
    assert first.subject == subjects.subject_for(e)
    info = await js.stream_info(subjects.STREAM)
    assert info.state.messages == 1


async def test_publish_many_keeps_order_and_reports_duplicates(js, events):
    pub = Publisher(js)
    evs = events(500, "mixed")
    out = await pub.publish_many(evs[:300], window=64)
    out += await pub.publish_many(evs[200:], window=64)
    assert [p.seq for p in out[:300]] == list(range(1, 301))
    assert all(p.duplicate for p in out[300:400])
    assert [p.seq for p in out[400:]] == list(range(301, 501))
    raw = await pub.publish_many([(subjects.digest_subject(), b"{}", None)])
    assert raw[0].seq == 501 and not raw[0].duplicate


async def test_publish_outside_the_stream_is_one_clear_error(js):
    with pytest.raises(PublishError, match="no stream stores this subject"):
        await Publisher(js).publish_raw("elsewhere.x", b"{}")
    with pytest.raises(PublishError, match="no stream stores this subject"):
        await Publisher(js).publish_many([("elsewhere.x", b"{}", "a")])


async def test_ensure_stream_is_idempotent_and_applies_changes(js):
    a = await ensure_stream(js)
    b = await ensure_stream(js)
    assert a.config.subjects == b.config.subjects == subjects.stream_subjects()
    c = await ensure_stream(js, duplicate_window_s=30)
    assert c.config.duplicate_window == 30
    assert "llmgw.heartbeat.>" not in c.config.subjects


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    try:
        yield exporter
    finally:
        tracing.use_provider(None)
        provider.shutdown()


async def test_a_consumer_span_shares_the_producer_trace_and_links_to_it(js, events, spans):
    (e,) = events(1)
    await Publisher(js).publish(e)
    handled = asyncio.Event()

    async def handler(d: Delivery) -> None:
        decode_checked(d)
        handled.set()

    stop = asyncio.Event()
    task = asyncio.create_task(
        consume_durable(
            js,
            durable="tracer",
            filter_subject="llmgw.>",
            handler=handler,
            stop=stop,
            fetch_timeout_s=0.2,
        )
    )
    await asyncio.wait_for(handled.wait(), 10)
    stop.set()
    await asyncio.wait_for(task, 5)

    by_kind = {s.kind: s for s in spans.get_finished_spans()}
    producer, consumer = by_kind[trace.SpanKind.PRODUCER], by_kind[trace.SpanKind.CONSUMER]
    assert consumer.context.trace_id == producer.context.trace_id
    assert consumer.parent is not None and consumer.parent.span_id == producer.context.span_id
    assert [link.context.span_id for link in consumer.links] == [producer.context.span_id]
    subject = subjects.subject_for(e)
    assert producer.attributes["messaging.system"] == "nats"
    assert producer.attributes["messaging.destination.name"] == subject
    assert producer.attributes["messaging.message.id"] == e.id
    assert producer.attributes["messaging.operation.type"] == "send"
    assert consumer.attributes["messaging.system"] == "nats"
    assert consumer.attributes["messaging.destination.name"] == subject
    assert consumer.attributes["messaging.message.id"] == e.id
    assert consumer.attributes["messaging.consumer.group.name"] == "tracer"


async def test_a_folded_batch_span_links_to_every_producer(js, events, spans):
    pub = Publisher(js)
    for e in events(3):
        await pub.publish(e)
    stop = asyncio.Event()
    read = [0]

    def on_batch(batch: list[Delivery]) -> None:
        read.append(batch[-1].seq)
        if read[-1] >= 3:
            stop.set()

    await follow.follow(js, position=lambda: read[-1], on_batch=on_batch, stop=stop, name="fold")
    finished = spans.get_finished_spans()
    producers = [s for s in finished if s.kind == trace.SpanKind.PRODUCER]
    (batch,) = [s for s in finished if s.kind == trace.SpanKind.CONSUMER]
    assert {link.context.span_id for link in batch.links} == {p.context.span_id for p in producers}
    assert batch.attributes["messaging.batch.message_count"] == 3


def test_encode_then_decode_is_the_same_event(events):
    for e in events(9, "mixed"):
        assert codec.decode(codec.encode(e)) == e


async def test_a_stream_of_another_root_is_refused_not_re_pointed(js) -> None:  # type: ignore[no-untyped-def]
    from services.bus import ensure_stream
    from services.bus.errors import StreamConflict

    before = await js.stream_info("LLMGW")
    with pytest.raises(StreamConflict, match="use --root llmgw"):
        await ensure_stream(js, root="staging")
    after = await js.stream_info("LLMGW")
    assert after.config.subjects == before.config.subjects


@pytest.mark.parametrize(
    ("env", "kinds", "warned"),
    [
        pytest.param({}, [], False, id="unset records nothing"),
        pytest.param({"OTEL_TRACES_EXPORTER": "none"}, [], False, id="none records nothing"),
        pytest.param(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ["otlp"], False, id="an endpoint"
        ),
        pytest.param(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"},
            [],
            False,
            id="none wins over an endpoint",
        ),
        pytest.param(
            {"OTEL_TRACES_EXPORTER": "otlp,console"}, ["otlp", "console"], False, id="both"
        ),
        pytest.param(
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            [],
            True,
            id="grpc is a warning, not a failure",
        ),
        pytest.param(
            {"OTEL_TRACES_EXPORTER": "zipkin"}, [], True, id="an unknown exporter is a warning"
        ),
        pytest.param({"OTEL_TRACES_EXPORTER": "console"}, ["console"], False, id="console"),
    ],
)
def test_tracing_follows_the_otel_variables(
    env: dict[str, str], kinds: list[str], warned: bool
) -> None:
    made, warnings = tracing.exporters_from_env(env)
    assert made == kinds
    assert bool(warnings) == warned
