"""Tracing for the bus: W3C trace context in message headers, spans per the OTel
messaging conventions.

Used by `publish` (PRODUCER spans, `inject`) and `consume` (CONSUMER spans linked to the
producer's context, `extract`), and by services at start (`setup_tracing`). It exports
nothing unless given an exporter: tracing must never be the reason a service cannot start.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

TRACER_NAME = "llmgw.bus"

# SYSTEM is the messaging.system attribute. "nats" is not a registered value yet; the
# conventions allow an unregistered one, and it says what it is.
SYSTEM = "nats"

_provider: trace.TracerProvider | None = None


def use_provider(provider: trace.TracerProvider | None) -> None:
    """Use `provider` for the bus's spans instead of the global one (tests; None undoes it).

    The global provider can be set once per process; tests need a fresh one each.
    """
    global _provider
    _provider = provider


def provider() -> trace.TracerProvider:
    return _provider if _provider is not None else trace.get_tracer_provider()


def tracer() -> trace.Tracer:
    return provider().get_tracer(TRACER_NAME)


def enabled() -> bool:
    """Whether spans are recorded at all. The bulk paths skip span work when they are not."""
    return isinstance(provider(), TracerProvider)


def setup_tracing(
    service_name: str,
    exporter: SpanExporter | None = None,
    *,
    processor: SpanProcessor | None = None,
    set_global: bool = True,
) -> TracerProvider:
    """An SDK tracer provider for a service; with no exporter, spans are made but go nowhere."""
    p = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if processor is not None:
        p.add_span_processor(processor)
    elif exporter is not None:
        p.add_span_processor(BatchSpanProcessor(exporter))
    if set_global:
        trace.set_tracer_provider(p)
    else:
        use_provider(p)
    return p


def setup_from_env(service_name: str) -> TracerProvider | None:
    """Tracing as the standard OpenTelemetry variable asks: `OTEL_TRACES_EXPORTER=console`
    prints every span (JSON) to stderr; unset or `none` records nothing. Another value is
    one warning and no tracing: llmgw ships only the console exporter, and tracing must
    never be the reason a service does not start."""
    import logging
    import os

    kind = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if kind in ("", "none"):
        return None
    if kind != "console":
        logging.getLogger("llmgw.bus").warning(
            "OTEL_TRACES_EXPORTER=%s is not available here (only console); tracing is off", kind
        )
        return None
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    return setup_tracing(service_name, ConsoleSpanExporter())


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context (`traceparent`, `tracestate`) to message headers."""
    propagate.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The producer's context carried by message headers (empty context if none)."""
    return propagate.extract(headers or {})


def span_context_of(ctx: otel_context.Context) -> trace.SpanContext | None:
    """The remote span context in `ctx`, if it carries a valid one."""
    sc = trace.get_current_span(ctx).get_span_context()
    return sc if sc.is_valid else None
