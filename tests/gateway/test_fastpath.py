"""The gateway's request-path speed-ups (`Gateway.fast_path`, `--no-fast-path`
turns them off) against the plain rule: the same requests through a gateway with them and
one without, following the same log, get the same answers and count the same metrics;
the kept metric children render as `labels()` each time does; no span is made only when
nothing records spans and the client sent no trace context."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from opentelemetry import trace

from services.agent.responder import Responder
from services.gateway.metrics import KeptLabelled, Labelled, Metrics
from services.gateway.request import NO_SPAN, span_of
from services.gateway.server import Gateway
from tests.bus.test_bus_publish import spans  # noqa: F401  (the fixture)
from tests.gateway.conftest import Plane, gateway_for, serving

pytestmark = [pytest.mark.timeout(30), pytest.mark.module_broker]


def _untimed(text: bytes) -> list[bytes]:
    """A rendering without the `_created` times (when each series was made)."""
    return [x for x in text.splitlines() if b"_created" not in x]


def test_kept_children_render_as_labels_each_time() -> None:
    plain, kept = Metrics(), Metrics()
    calls: list[tuple[str, tuple[str, ...], float]] = [
        ("requests", ("m", "200"), 1),
        ("requests", ("m", "200"), 1),
        ("requests", ("m", "404"), 1),
        ("requests", ("(unknown)", "400"), 1),
        ("owner_requests", ("(none)", "200"), 1),
        ("owner_tokens", ("ann", "in"), 12),
        ("duration", ("m",), 0.004),
        ("duration", ("m",), 0.2),
        ("first_byte", ("m",), 0.001),
        ("inflight", ("m",), 1),
        ("inflight", ("m",), -1),
        ("inflight", ("n",), 1),
    ]
    for metrics, labelled in ((plain, Labelled()), (kept, KeptLabelled())):
        for name, values, x in calls:
            child = labelled.of(getattr(metrics, name), *values)
            if hasattr(child, "observe"):
                child.observe(x)
            else:
                child.inc(x)
    assert _untimed(kept.render()) == _untimed(plain.render())
    k = KeptLabelled()
    assert k.of(kept.requests, "m", "200") is k.of(kept.requests, "m", "200")


def _gateway(js: JetStreamContext, fast: bool) -> Gateway:
    return gateway_for(js, fast_path=fast)


@pytest.fixture
async def plain(nc: Client, js: JetStreamContext, plane: Plane) -> AsyncIterator[Gateway]:
    """A second gateway on the plane's log, with the fast path off."""
    gw = _gateway(js, fast=False)
    async with serving(gw):
        yield gw


def _refusing() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


TRACEPARENT = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
_ID = re.compile(rb'"(chatcmpl|cmpl)-[^"]*"|"created": ?\d+')
# Histograms' sums and buckets hold the times measured; their counts do not.
_TIMED = re.compile(r"_(sum|bucket)[{ ]|_created")


async def _answers(http: aiohttp.ClientSession, url: str) -> list[tuple[int, str, bytes]]:
    """What one gateway answers to the same requests: status, reason, body (ids and
    times taken out)."""
    chat = {"model": "fp", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    asks: list[tuple[str, Any]] = [
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "user": "ann"}),
        ("/v1/completions", {"model": "fp", "prompt": "hi", "max_tokens": 3, "stream": True}),
        (
            "/v1/completions",
            {
                "model": "fp",
                "prompt": "hi",
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
        ("/v1/embeddings", {"model": "fp", "input": "hi"}),
        ("/v1/chat/completions", {**chat, "model": "fpp"}),
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {**chat, "model": "dead"}),
    ]
    out = []
    for i, (path, body) in enumerate(asks):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        # Every other one with a trace context (which the fast path does not skip).
        headers = {"Content-Type": "application/json"}
        if i % 2:
            headers["traceparent"] = TRACEPARENT
        async with http.post(f"{url}{path}", data=data, headers=headers) as r:
            got = await r.read()
            out.append((r.status, r.headers.get("x-llmgw-reason", ""), _ID.sub(b"ID", got)))
    return out


async def _metrics(http: aiohttp.ClientSession, url: str) -> list[str]:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    return [x for x in text.splitlines() if x.startswith("llmgw_") and not _TIMED.search(x)]


async def test_the_same_requests_get_the_same_answers_and_metrics_either_way(
    plane: Plane, plain: Gateway, servers: Callable[..., Awaitable[Responder]]
) -> None:
    assert plane.gateway.fast_path and not plain.fast_path
    await plane.model("fp")
    await plane.model("dead")
    s = await servers("fp-1", "fp")
    await plane.ready("fp-dead", "fp", _refusing())
    await plane.ready("fp-1", "fp", s.endpoint)
    await plane.ready("dead-1", "dead", _refusing())
    await plain.follower.wait_for(plane.gateway.follower.seq, 5)
    fast = await _answers(plane.http, plane.url)
    slow = await _answers(plane.http, plain.url)
    assert fast == slow
    assert [a[0] for a in fast] == [200, 200, 200, 200, 200, 404, 400, 400, 503]
    assert await _metrics(plane.http, plane.url) == await _metrics(plane.http, plain.url)
    assert plane.gateway.router.inflight == {} and plain.router.inflight == {}


def _request(headers: dict[str, str]) -> Any:
    class R:
        path = "/v1/chat/completions"

    r = R()
    r.headers = headers  # type: ignore[attr-defined]
    return r


def test_no_span_only_when_nothing_records_and_no_trace_context_came() -> None:
    fast, plain = _gateway(None, fast=True), _gateway(None, fast=False)
    assert span_of(_request({}), fast.fast_path) is NO_SPAN
    assert span_of(_request({}), plain.fast_path) is not NO_SPAN
    # A client's trace context is carried on (into what the request makes, such as a
    # wake's `model.demanded`), recorded or not.
    traced = {"traceparent": TRACEPARENT}
    with span_of(_request(traced), fast.fast_path) as span:
        assert span.get_span_context().trace_id == int("1" * 32, 16)
        assert trace.get_current_span() is span


def test_with_an_exporter_every_request_has_its_span(spans: Any) -> None:  # noqa: F811
    fast = _gateway(None, fast=True)
    with span_of(_request({}), fast.fast_path) as span:
        assert span.is_recording()
