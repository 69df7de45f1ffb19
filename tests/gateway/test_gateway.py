"""The gateway in this process, on a real broker, in front of real HTTP servers: simulated
model servers (services.agent.responder), a port that refuses, a server that answers
garbage and one that never answers. The log is written by the test, so each case says
exactly what was folded when: a drain folded is the end of a replica's requests, a
failure before the first byte is tried once elsewhere, and every refusal is an OpenAI
error with its status and reason."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from schemas import events as ev
from services.agent.responder import Responder, Timing
from tests.agent.helpers import node_events, wait_for
from tests.bus.test_bus_publish import spans  # noqa: F401  (the fixture)
from tests.gateway.conftest import Plane

pytestmark = [pytest.mark.timeout(30), pytest.mark.module_broker]

# JSON_HEADERS say a body is JSON: the gateway takes no other (415).
JSON_HEADERS = {"Content-Type": "application/json"}


@contextlib.asynccontextmanager
async def raw_server(answer: bytes | None) -> AsyncIterator[str]:
    """A TCP server that reads the request and sends `answer` (None: nothing, ever)."""
    held: list[asyncio.StreamWriter] = []
    silence = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        with contextlib.suppress(Exception):
            await reader.read(65536)
            if answer is None:
                await silence.wait()
            else:
                writer.write(answer)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        silence.set()
        server.close()
        for w in held:
            w.close()
            with contextlib.suppress(Exception):
                await w.wait_closed()
        await server.wait_closed()


def _refusing() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _error(status: int, headers: dict[str, str], body: bytes, code: str) -> dict[str, Any]:
    doc = json.loads(body)
    # The code, and after it the same in words where the code alone does not say enough.
    assert headers["x-llmgw-reason"].split(": ")[0] == code, body
    assert set(doc["error"]) == {"message", "type", "code"} and doc["error"]["code"] == code
    return dict(doc["error"])


async def test_requests_spread_by_in_flight_and_sessions_stay_on_their_replica(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await plane.model("spread")
    for i in range(3):
        s = await servers(f"sp-{i}", "spread")
        await plane.ready(f"sp-{i}", "spread", s.endpoint)
    seen = [(await plane.chat("spread"))[1]["x-llmgw-replica"] for _ in range(6)]
    # One at a time, none in flight: ties go to the replica picked longest ago.
    assert seen == ["sp-0", "sp-1", "sp-2", "sp-0", "sp-1", "sp-2"]
    # A session (the `user` field, or the x-session-id header) stays where it started.
    by_user = {(await plane.chat("spread", user="ann"))[1]["x-llmgw-replica"] for _ in range(4)}
    assert len(by_user) == 1
    sticky = set()
    for _ in range(4):
        _, h, _ = await plane.post(
            "/v1/completions",
            {"model": "spread", "prompt": "x"},
            headers={"x-session-id": "s-1"},
        )
        sticky.add(h["x-llmgw-replica"])
    assert len(sticky) == 1
    assert plane.gateway.router.inflight == {}


async def test_a_drain_folded_is_the_end_of_a_replicas_requests(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await plane.model("drained")
    a = await servers("dr-a", "drained")
    b = await servers("dr-b", "drained")
    await plane.ready("dr-a", "drained", a.endpoint)
    await plane.ready("dr-b", "drained", b.endpoint)
    _, h, _ = await plane.chat("drained", user="bob")
    first = h["x-llmgw-replica"]
    await plane.drain(first, "drained")
    # Its server still answers (its agent has not even acted), but nothing goes there,
    # not even the session it served.
    served = (a if first == "dr-a" else b).served
    for _ in range(5):
        status, h, _ = await plane.chat("drained", user="bob")
        assert status == 200 and h["x-llmgw-replica"] != first
    assert (a if first == "dr-a" else b).served == served
    # The last one drained: the request waits for another (never a 404), for as long
    # as a start may take (the fixture's short floor here), then 429 with Retry-After,
    # in the OpenAI shape.
    await plane.drain("dr-b" if first == "dr-a" else "dr-a", "drained")
    status, h, body = await plane.chat("drained")
    assert status == 429 and int(h["Retry-After"]) >= 1
    _error(status, h, body, "not_ready_in_time")
    assert plane.gateway.room.held() == 0


async def test_a_lost_node_leaves_routing_and_a_cordoned_one_keeps_its_sessions(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await plane.model("nodes")
    other = f"{plane.node}-b"
    await plane.inventory(other, 1)
    a = await servers("nd-a", "nodes")
    b = await servers("nd-b", "nodes")
    await plane.ready("nd-a", "nodes", a.endpoint)
    on_other = (ev.ShardSpec(node=other, gpus=(0,)),)
    await plane.say(
        ev.PlacementDecided(replica="nd-b", model="nodes", profile="p", shards=on_other, reason="")
    )
    await plane.say(
        ev.ReplicaState(
            replica="nd-b",
            model="nodes",
            profile="p",
            state="ready",
            shards=(ev.ShardSpec(node=other, gpus=(0,)),),
            endpoint=b.endpoint,
        ),
        node=other,
    )
    # A session on nd-b, then nd-b's node cordoned: the session stays, new ones do not go.
    users = [f"u{i}" for i in range(8)]
    on = {u: (await plane.chat("nodes", user=u))[1]["x-llmgw-replica"] for u in users}
    cara = next(u for u in users if on[u] == "nd-b")
    await plane.say(ev.NodeCordoned(node=other))
    assert (await plane.chat("nodes", user=cara))[1]["x-llmgw-replica"] == "nd-b"
    assert {(await plane.chat("nodes"))[1]["x-llmgw-replica"] for _ in range(3)} == {"nd-a"}
    await plane.say(ev.NodeLost(node=other, reason="test"))
    assert (await plane.chat("nodes", user=cara))[1]["x-llmgw-replica"] == "nd-a"


async def test_a_failure_before_the_first_byte_is_tried_once_elsewhere(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await plane.model("retry")
    good = await servers("rt-good", "retry")
    await plane.ready("rt-dead", "retry", _refusing())
    await plane.ready("rt-good", "retry", good.endpoint)
    retries = plane.gateway.counts.retries
    for _ in range(4):
        status, h, _ = await plane.chat("retry")
        assert status == 200 and h["x-llmgw-replica"] == "rt-good"
    assert plane.gateway.counts.retries > retries
    # Two replicas that both refuse: once more, then 503 (nothing can serve now).
    await plane.model("refused")
    await plane.ready("rf-1", "refused", _refusing())
    await plane.ready("rf-2", "refused", _refusing())
    status, h, body = await plane.chat("refused")
    assert status == 503
    _error(status, h, body, "no_replica")
    assert plane.gateway.router.inflight == {}
    # /metrics counts them: by model and status, the retries, none left in flight.
    async with plane.http.get(f"{plane.url}/metrics") as r:
        text = (await r.text()).splitlines()

    def value(prefix: str) -> float:
        return sum(float(x.rsplit(" ", 1)[1]) for x in text if x.startswith(prefix))

    assert value('llmgw_gateway_requests_total{model="retry",status="200"}') == 4
    assert value('llmgw_gateway_requests_total{model="refused",status="503"}') == 1
    # And why, for the 5xx alert's drill-down: the refusal's x-llmgw-reason code.
    assert value('llmgw_gateway_errors_total{model="refused",reason="no_replica"}') == 1
    assert value('llmgw_gateway_errors_total{model="retry"') == 0
    assert value("llmgw_gateway_retries_total") >= 2
    assert value('llmgw_gateway_inflight{model="retry"}') == 0
    assert value('llmgw_gateway_time_to_first_byte_seconds_count{model="retry"}') == 4
    assert value("llmgw_gateway_added_seconds_count") >= 5


async def test_garbage_and_silence_from_a_replica_are_502_and_504(plane: Plane) -> None:
    await plane.model("bad")
    async with raw_server(b"this is not HTTP\r\n\r\n") as garbage:
        await plane.ready("bad-1", "bad", garbage)
        status, h, body = await plane.chat("bad")
    assert status == 502
    _error(status, h, body, "bad_upstream")
    await plane.model("stuck")
    async with raw_server(None) as silent:
        await plane.ready("st-1", "stuck", silent)
        status, h, body = await plane.chat("stuck")
    assert status == 504
    _error(status, h, body, "upstream_timeout")
    assert plane.gateway.router.inflight == {}


async def test_bad_requests_get_their_status_and_one_line(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await plane.model("llama-70b", aliases=("llama",))
    s = await servers("ok-1", "llama-70b")
    await plane.ready("ok-1", "llama-70b", s.endpoint)
    cases = [
        (b'{"model": "llama-70b", "messages": [', 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"messages": []}', 400, "missing_model"),
        (b'{"model": 7}', 400, "missing_model"),
        (b'{"model": "llama-7b"}', 404, "unknown_model"),
    ]
    for raw, want, code in cases:
        status, h, body = await plane.post("/v1/chat/completions", raw=raw)
        assert status == want, raw
        err = _error(status, h, body, code)
    assert "did you mean llama-70b?" in err["message"]
    big = b'{"model": "llama", "pad": "' + b"x" * (plane.gateway.max_body + 1) + b'"}'
    status, h, body = await plane.post("/v1/chat/completions", raw=big)
    assert status == 413
    _error(status, h, body, "body_too_large")

    async def chunked() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    # Without a Content-Length (chunked), counted as it arrives.
    async with plane.http.post(
        f"{plane.url}/v1/chat/completions", data=chunked(), headers=JSON_HEADERS
    ) as r:
        assert r.status == 413
        _error(r.status, dict(r.headers), await r.read(), "body_too_large")
    async with plane.http.get(f"{plane.url}/v1/chat/completions") as r:
        assert r.status == 405
        _error(r.status, dict(r.headers), await r.read(), "method_not_allowed")
    # An alias routes like the name; the body reaches the server as it was sent.
    status, h, body = await plane.chat("llama", max_tokens=2)
    assert status == 200 and h["x-llmgw-replica"] == "ok-1"
    async with plane.http.get(f"{plane.url}/v1/models") as r:
        ids = {m["id"]: m for m in (await r.json())["data"]}
    assert ids["llama"]["root"] == "llama-70b" and ids["llama-70b"]["llmgw"]["replicas"] == 1


async def test_a_stream_passes_through_byte_for_byte_and_a_disconnect_cancels_it(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await plane.model("streamy")
    s = await servers("sm-1", "streamy", Timing(0.0, 20.0))
    await plane.ready("sm-1", "streamy", s.endpoint)
    body = {"model": "streamy", "prompt": "p", "stream": True, "max_tokens": 3}
    async with plane.http.post(f"{s.endpoint}/v1/completions", json=body) as r:
        direct = await r.read()
    status, h, through = await plane.post("/v1/completions", body)
    assert status == 200 and h["Content-Type"].startswith("text/event-stream")

    # The same bytes but the id's counter and the clock (each answer is numbered and
    # stamped by its server).
    def same(b: bytes) -> bytes:
        return re.sub(rb'"created": \d+', b"", re.sub(rb"sm-1-\d+", b"", b))

    assert same(through) == same(direct) and through.endswith(b"data: [DONE]\n\n")
    # The gateway asked for the usage chunk and took it out; a client that asks gets it.
    assert b'"usage"' not in through
    asking = {**body, "stream_options": {"include_usage": True}}
    async with plane.http.post(f"{s.endpoint}/v1/completions", json=asking) as r:
        direct = await r.read()
    status, h, through = await plane.post("/v1/completions", asking)
    assert same(through) == same(direct) and b'"choices": [], "usage"' in through
    # A client that goes away mid-stream: the upstream request ends at once.
    long = {**body, "max_tokens": 4000}
    async with plane.http.post(f"{plane.url}/v1/completions", json=long) as r:
        await r.content.readany()
        assert plane.gateway.router.inflight == {"sm-1": 1}

    async def counts() -> tuple[dict[str, int], int]:
        return dict(plane.gateway.router.inflight), s.active

    await wait_for(counts, lambda c: c == ({}, 0), 5)


async def test_use_is_published_with_requests_and_tokens_at_most_once_an_interval(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await plane.model("used")
    s = await servers("us-1", "used")
    await plane.ready("us-1", "used", s.endpoint)
    out = 0
    for _ in range(3):
        _, _, body = await plane.chat("used", max_tokens=4)
        out += json.loads(body)["usage"]["completion_tokens"]
    # A stream counts its tokens whether its client asked for the usage chunk or not
    # (the gateway asks on its behalf).
    await plane.post(
        "/v1/completions",
        {
            "model": "used",
            "prompt": "x",
            "stream": True,
            "max_tokens": 2,
            "stream_options": {"include_usage": True},
        },
    )
    await plane.post(
        "/v1/completions", {"model": "used", "prompt": "x", "stream": True, "max_tokens": 3}
    )
    out += 2 + 3

    async def used() -> list[ev.ReplicaUsedEvent]:
        es = await node_events(plane.gateway.js, plane.node)
        return [e for e in es if isinstance(e, ev.ReplicaUsedEvent)]

    reports = await wait_for(used, lambda u: sum(e.data.requests or 0 for e in u) == 5, 5)
    assert {e.source for e in reports} == {"gateway"}
    assert sum(e.data.tokens_out or 0 for e in reports) == out
    assert sum(e.data.tokens_in or 0 for e in reports) > 0
    gaps = [(b.time - a.time).total_seconds() for a, b in itertools.pairwise(reports)]
    assert all(g >= 0.25 for g in gaps), gaps
    # The fold takes it as any use: the replica's last use is the last request's.
    await plane.gateway.follower.caught_up(5)
    assert plane.gateway.follower.view.replicas["us-1"].last_used_at == reports[-1].data.at


async def test_a_body_that_never_ends_is_408_and_the_gateway_stays_up(plane: Plane) -> None:
    plane.gateway.body_timeout_s = 0.3
    host, port = plane.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model": "x"'
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 408") and b"x-llmgw-reason: body_timeout" in head.lower()
    writer.close()
    await writer.wait_closed()
    async with plane.http.get(f"{plane.url}/v1/models") as r:
        assert r.status == 200


async def test_many_clients_gone_at_once_leave_nothing_in_flight(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await plane.model("crowd", target_inflight=10)  # twenty in flight at once
    s = await servers("cr-1", "crowd", Timing(0.0, 50.0))
    await plane.ready("cr-1", "crowd", s.endpoint)
    body = json.dumps({"model": "crowd", "prompt": "p", "stream": True, "max_tokens": 500})
    responses = []
    for _ in range(20):
        r = await plane.http.post(f"{plane.url}/v1/completions", data=body, headers=JSON_HEADERS)
        await r.content.readany()
        responses.append(r)
    assert plane.gateway.router.inflight == {"cr-1": 20}
    for r in responses:
        r.close()  # twenty clients gone mid-stream, at once

    async def counts() -> tuple[dict[str, int], int]:
        return dict(plane.gateway.router.inflight), s.active

    await wait_for(counts, lambda c: c == ({}, 0), 5)
    status, _, _ = await plane.chat("crowd", max_tokens=1)
    assert status == 200


async def test_each_request_is_a_span_with_model_replica_status_and_retry(
    plane: Plane,
    servers: Callable[..., Awaitable[Responder]],
    spans: Any,  # noqa: F811
) -> None:
    await plane.model("traced")
    good = await servers("tr-good", "traced")
    await plane.ready("tr-dead", "traced", _refusing())
    await plane.ready("tr-good", "traced", good.endpoint)
    for _ in range(2):
        assert (await plane.chat("traced"))[0] == 200
    assert (await plane.chat("nope"))[0] == 404
    mine = [s for s in spans.get_finished_spans() if s.name == "POST /v1/chat/completions"]
    assert len(mine) == 3
    attrs = [dict(s.attributes or {}) for s in mine]
    assert [a["http.response.status_code"] for a in attrs] == [200, 200, 404]
    assert all(a["llmgw.replica"] == "tr-good" for a in attrs[:2])
    assert any(a.get("llmgw.retry") for a in attrs[:2])
    assert attrs[2]["llmgw.reason"] == "unknown_model"
    assert attrs[0]["gen_ai.request.model"] == "traced"
