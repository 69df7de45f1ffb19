"""Tracing for the bus: W3C trace context in message headers, spans per the OTel
messaging conventions.

Used by `publish` (PRODUCER spans, `inject`) and `consume` (CONSUMER spans linked to the
producer's context, `extract`), and by services at start (`setup_from_env`: the standard
`OTEL_*` variables, OTLP/HTTP to a collector). It exports nothing unless given an
exporter: tracing must never be the reason a service cannot start.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.environment_variables import OTEL_PYTHON_TRACER_PROVIDER
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
    """Whether spans are recorded at all. The bulk paths skip span work when they are not.

    Asked for each request a gateway serves. While no global provider is set,
    OpenTelemetry's lookup (`get_tracer_provider`) reads the environment each time for
    a provider named there (2% of a gateway's request): that is read once a process
    here, and the global provider itself looked at, as the lookup would."""
    p = _provider
    if p is None:
        p = getattr(trace, "_TRACER_PROVIDER", None)
        if p is None:
            if not _provider_named():
                return False
            p = trace.get_tracer_provider()
    return isinstance(p, TracerProvider)


@functools.cache
def _provider_named() -> bool:
    """Whether the environment names a global provider (OpenTelemetry loads it at the
    first lookup, and only then)."""
    return OTEL_PYTHON_TRACER_PROVIDER in os.environ


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


# OTLP_ENDPOINT_VARS are the standard variables that name a collector. Either one set
# turns the OTLP exporter on when OTEL_TRACES_EXPORTER does not say otherwise.
OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

# OTLP_PROTOCOL_VARS say which OTLP transport; llmgw ships OTLP over HTTP (protobuf).
OTLP_PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


def exporters_from_env(env: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(exporters to make, warnings) as the standard OpenTelemetry variables ask.

    `OTEL_TRACES_EXPORTER` is a comma-separated list of `otlp`, `console`, `none`. Unset,
    it is `otlp` when a collector's endpoint is set, else `none`. OTLP is spoken over
    HTTP with protobuf; a request for gRPC or JSON is a warning and no OTLP exporter.
    """
    given = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not given:
        given = "otlp" if any(env.get(v) for v in OTLP_ENDPOINT_VARS) else "none"
    kinds: list[str] = []
    warnings: list[str] = []
    for kind in (k.strip() for k in given.split(",")):
        if kind in ("", "none") or kind in kinds:
            continue
        if kind == "otlp":
            protocol = next((env[v] for v in OTLP_PROTOCOL_VARS if env.get(v)), "http/protobuf")
            if protocol.strip().lower() != "http/protobuf":
                warnings.append(
                    f"OTLP over {protocol} is not available here (only http/protobuf); "
                    "no spans go to the collector"
                )
                continue
        elif kind != "console":
            warnings.append(
                f"OTEL_TRACES_EXPORTER={kind} is not available here (only otlp and console)"
            )
            continue
        kinds.append(kind)
    return kinds, warnings


def setup_from_env(service_name: str, *, set_global: bool = True) -> TracerProvider | None:
    """Tracing as the standard OpenTelemetry variables ask (see `exporters_from_env`):
    spans to a collector over OTLP/HTTP (`OTEL_EXPORTER_OTLP_ENDPOINT`, and the exporter's
    own `OTEL_EXPORTER_OTLP_*` for headers, timeout, compression), to stderr as JSON
    (`console`), or nowhere. `OTEL_SERVICE_NAME` names the service when set. What cannot
    be honoured is one warning each: tracing must never be the reason a service does not
    start."""
    import logging
    import os

    kinds, warnings = exporters_from_env(os.environ)
    for w in warnings:
        logging.getLogger("llmgw.bus").warning("tracing: %s", w)
    if not kinds:
        return None
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    exporters: list[SpanExporter] = []
    for kind in kinds:
        if kind == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        else:
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
    p = setup_tracing(name, exporters[0], set_global=set_global)
    for more in exporters[1:]:
        p.add_span_processor(BatchSpanProcessor(more))
    return p


# REMEMBERED bounds the trace contexts kept of the events a process has folded. A
# reaction comes within seconds of what it reacts to; more would only hold memory.
REMEMBERED = 65_536

_seen: OrderedDict[str, tuple[int, Mapping[str, str]]] = OrderedDict()


def remember(seq: int, headers: Mapping[str, str] | None, *keys: str | None) -> None:
    """Keep the trace context an event carried (at stream sequence `seq`) under each of
    `keys` (its id, its subject), so a reaction published later, by a service that read
    the event from the log rather than in a handler, joins the event's trace."""
    if not headers or "traceparent" not in headers:
        return
    for key in keys:
        if key:
            _seen[key] = (seq, headers)
            _seen.move_to_end(key)
    while len(_seen) > REMEMBERED:
        _seen.popitem(last=False)


def recalled(cause: str | None, *latest_of: str) -> otel_context.Context | None:
    """The trace context of event id `cause` if remembered, else of the most recent event
    remembered under any of `latest_of` (subjects), else None."""
    if cause and cause in _seen:
        return extract(_seen[cause][1])
    found = [_seen[k] for k in latest_of if k in _seen]
    if not found:
        return None
    return extract(max(found, key=lambda x: x[0])[1])


def forget() -> None:
    """Drop every remembered context (tests)."""
    _seen.clear()


def inject(headers: dict[str, str], context: otel_context.Context | None = None) -> dict[str, str]:
    """Add the current trace context (or `context`'s) to message headers."""
    propagate.inject(headers, context=context)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The producer's context carried by message headers (empty context if none)."""
    return propagate.extract(headers or {})


def span_context_of(ctx: otel_context.Context) -> trace.SpanContext | None:
    """The remote span context in `ctx`, if it carries a valid one."""
    sc = trace.get_current_span(ctx).get_span_context()
    return sc if sc.is_valid else None
