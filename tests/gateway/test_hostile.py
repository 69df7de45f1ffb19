"""Hostile and broken input at the gateway: a real gateway on a real broker, in front of
real simulated model servers and of raw TCP servers that misbehave, attacked with the
aiohttp client where it can say the attack and with raw sockets where it cannot.

Each kind gets its documented status (README, "The gateway") or a clean close, and
after each one the gateway still answers and its in-flight counts are back to zero
(`after`: /health's per-replica counts, /metrics' per-model gauge).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from services.agent.responder import MAX_N, Responder, Timing
from tests.agent.helpers import wait_for
from tests.gateway.conftest import Plane
from tests.gateway.test_gateway import _error, raw_server

pytestmark = [pytest.mark.timeout(60), pytest.mark.module_broker]

MODEL = "hostile"
JSON_HEADERS = {"Content-Type": "application/json"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
async def gw(plane: Plane, servers: Callable[..., Awaitable[Responder]]) -> AsyncIterator[Plane]:
    """The plane with `hostile` served by one fast simulated server, its replica
    `plane.rid` (an id of this test's own: the module's tests share one log)."""
    plane.gateway.body_timeout_s = 0.5
    plane.rid = f"hostile-{plane.node}"  # type: ignore[attr-defined]
    await plane.model(MODEL, aliases=("hostile-alias",))
    s = await servers(plane.rid, MODEL)  # type: ignore[attr-defined]
    await plane.ready(plane.rid, MODEL, s.endpoint)  # type: ignore[attr-defined]
    yield plane
    await plane.drain(plane.rid, MODEL)  # type: ignore[attr-defined]


async def after(plane: Plane) -> None:
    """The gateway is up and nothing is left in flight through it."""

    async def state() -> tuple[int, dict[str, int], float]:
        async with plane.http.get(f"{plane.url}/health") as r:
            status, health = r.status, await r.json()
        async with plane.http.get(f"{plane.url}/metrics") as r:
            lines = (await r.text()).splitlines()
        gauge = sum(
            float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("llmgw_gateway_inflight{")
        )
        return status, health["inflight"], gauge

    await wait_for(state, lambda s: s == (200, {}, 0.0), 5)
    status, _, body = await plane.chat(MODEL)
    assert status == 200, body


def _addr(plane: Plane) -> tuple[str, int]:
    host, port = plane.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def raw(plane: Plane, data: bytes, *, within_s: float = 5.0) -> bytes:
    """Send `data` on a connection of its own; all it gets back until the gateway closes
    it (or `within_s` passes, when what came so far is returned)."""
    reader, writer = await asyncio.open_connection(*_addr(plane))
    try:
        writer.write(data)
        await writer.drain()
        got = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(within_s):
                while chunk := await reader.read(65536):
                    got += chunk
        return got
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


# JSON is the header of a body the gateway takes (`guard.Boundary`: another type is 415).
JSON = b"Content-Type: application/json\r\n"
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + JSON


def _request(body: bytes, *, head: bytes = b"", path: bytes = b"/v1/chat/completions") -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + JSON + head
        + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


def _status(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1."), answer[:200]
    return int(answer.split(b" ", 2)[1])


# ---------------------------------------------------------------- bodies


DEEP = 30_000  # 60 KB, under the fixture's 64 KiB limit


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        pytest.param(b'{"model": "hostile", "messages": [', 400, "invalid_json", id="truncated"),
        pytest.param(b"[1, 2]", 400, "invalid_json", id="a JSON array"),
        pytest.param(b'"hostile"', 400, "invalid_json", id="a JSON string"),
        pytest.param(b"null", 400, "invalid_json", id="null"),
        pytest.param(b"", 400, "invalid_json", id="empty"),
        pytest.param(
            b'{"model": "hostile", "messages": "\xc3\x28"}', 400, "invalid_json", id="bad UTF-8"
        ),
        pytest.param(b'{"model": "host\xffile"}', 400, "invalid_json", id="bad UTF-8 in model"),
        pytest.param(
            b'{"model": "hostile", "messages": ' + b"[" * DEEP + b"]" * DEEP + b"}",
            400,
            "invalid_json",
            id="a nesting bomb",
        ),
        pytest.param(b'{"messages": []}', 400, "missing_model", id="no model"),
        pytest.param(b'{"model": ["hostile"]}', 400, "missing_model", id="model not a string"),
        pytest.param(b'{"model": "hostyle"}', 404, "unknown_model", id="unknown model"),
    ],
)
async def test_a_body_that_is_not_a_request_is_refused(
    gw: Plane, body: bytes, status: int, reason: str
) -> None:
    got, h, answer = await gw.post("/v1/chat/completions", raw=body)
    assert got == status, answer
    err = _error(got, h, answer, reason)
    assert "\n" not in err["message"] and len(err["message"]) < 300
    await after(gw)


async def test_an_unknown_model_gets_a_did_you_mean_and_a_huge_name_no_stall(gw: Plane) -> None:
    status, h, body = await gw.chat("hostile-alais")
    assert (
        status == 404
        and "did you mean hostile-alias?" in _error(status, h, body, "unknown_model")["message"]
    )
    # A name of 2 MiB: refused at once (a did-you-mean over it holds the loop for a
    # second or more), the answer short.
    gw.gateway.max_body = 4 * 2**20
    body = json.dumps({"model": "x" * 2**21}).encode()
    t = time.perf_counter()
    async with gw.http.post(
        f"{gw.url}/v1/chat/completions", data=io.BytesIO(body), headers=JSON_HEADERS
    ) as r:
        status, h, body = r.status, dict(r.headers), await r.read()
    assert status == 404 and time.perf_counter() - t < 1.0
    assert (
        len(body) < 1024
        and "at most 253 characters" in _error(status, h, body, "unknown_model")["message"]
    )
    await after(gw)


async def test_a_key_given_twice_counts_as_its_last_for_gateway_and_replica(gw: Plane) -> None:
    body = b'{"model": "nope", "messages": [], "model": "hostile", "max_tokens": 1}'
    status, h, answer = await gw.post("/v1/chat/completions", raw=body)
    assert status == 200 and h["x-llmgw-replica"] == gw.rid  # type: ignore[attr-defined]
    assert json.loads(answer)["model"] == MODEL
    await after(gw)


async def test_a_huge_n_is_the_replicas_own_400_passed_through(gw: Plane) -> None:
    for n in (10**9, 0, "many"):
        status, h, body = await gw.chat(MODEL, n=n)
        assert status == 400, body
        doc = json.loads(body)
        assert set(doc["error"]) == {"message", "type", "code"}
        assert f"n must be an integer from 1 to {MAX_N}" in doc["error"]["message"]
        assert h["x-llmgw-replica"] == gw.rid  # type: ignore[attr-defined]
    status, _, body = await gw.chat(MODEL, n=3)
    assert status == 200 and [c["index"] for c in json.loads(body)["choices"]] == [0, 1, 2]
    await after(gw)


async def test_a_body_not_said_to_be_json_is_415_and_nothing_forwarded(gw: Plane) -> None:
    # JSON with parameters, or a +json type, is JSON; anything else (curl -d's
    # form-urlencoded, a page's text/plain, no type at all) is 415 before the body is read.
    for ctype in ("application/json; charset=utf-8", "Application/JSON", "application/x+json"):
        status, _, body = await gw.post(
            "/v1/chat/completions", CHAT, headers={"Content-Type": ctype}
        )
        assert status == 200, (ctype, body)
    served = gw.gateway.counts.by_model.get(MODEL, 0)
    for ctype in ("application/x-www-form-urlencoded", "text/plain", "image/png", "json"):
        status, h, body = await gw.post(
            "/v1/chat/completions", CHAT, headers={"Content-Type": ctype}
        )
        assert (
            "Content-Type: application/json"
            in _error(status, h, body, "unsupported_content_type")["message"]
        )
        assert status == 415
    form = aiohttp.FormData({"model": MODEL})
    async with gw.http.post(f"{gw.url}/v1/chat/completions", data=form()) as r:
        assert r.status == 415
        _error(r.status, dict(r.headers), await r.read(), "unsupported_content_type")
    answer = await raw(gw, _request(json.dumps(CHAT).encode()).replace(JSON, b""))
    assert _status(answer) == 415 and b"no Content-Type" in answer
    assert gw.gateway.counts.by_model.get(MODEL, 0) == served
    await after(gw)


async def test_a_100_mb_body_is_413_before_it_is_read(gw: Plane) -> None:
    limit = gw.gateway.max_body
    # Said by its Content-Length: refused on the headers alone, the body never sent.
    head = HEAD + b"Content-Length: 104857600\r\n\r\n"
    answer = await raw(gw, head + b'{"model": "hostile", "pad": "')
    assert _status(answer) == 413 and b"body_too_large" in answer
    # Chunked, with no length: counted as it comes, cut at the limit; the client may
    # still be sending when the 413 comes back.
    reader, writer = await asyncio.open_connection(*_addr(gw))
    writer.write(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    sent = 0
    answer_soon = asyncio.create_task(reader.read(65536))
    with contextlib.suppress(ConnectionError):
        while sent < 100 * 2**20 and not answer_soon.done():
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
            sent += len(chunk)
            await asyncio.sleep(0)
    answer = await asyncio.wait_for(answer_soon, 5)
    writer.close()
    assert _status(answer) == 413 and sent < 100 * 2**20, sent
    assert sent <= limit + 64 * 65536
    await after(gw)


# ---------------------------------------------------------------- HTTP itself


async def test_a_header_with_a_bare_cr_or_lf_is_400_and_nothing_forwarded(gw: Plane) -> None:
    for head in (
        b"X-Request-Id: a\rX-Evil: 1\r\n",  # a CR alone, to smuggle a header past a proxy
        b"X-Request-Id: a\nX-Evil: 1\r\n",  # an LF alone
        b"X Evil: 1\r\n",  # a space in a name
        b"X-Request-Id: \x00\r\n",  # a NUL
    ):
        served = gw.gateway.counts.requests
        answer = await raw(gw, _request(json.dumps(CHAT).encode(), head=head))
        assert _status(answer) == 400, (head, answer[:200])
        assert gw.gateway.counts.requests == served  # refused by the parser, no handler ran
    await after(gw)


async def test_only_the_listed_headers_reach_the_replica(gw: Plane) -> None:
    got: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.readuntil(b"\r\n\r\n"))
        body = b'{"ok": true}'
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Evil: 1\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await gw.model("spy")
        await gw.ready("spy-1", "spy", f"http://127.0.0.1:{port}")
        status, h, _ = await gw.post(
            "/v1/chat/completions",
            {"model": "spy"},
            headers={
                "Authorization": "Bearer sk-secret",
                "X-Forwarded-For": "6.6.6.6",
                "X-Request-Id": "req-1",
                "Cookie": "session=1",
                "Content-Type": "application/json; charset=utf-8",
            },
        )
    finally:
        server.close()
        await server.wait_closed()
    assert status == 200 and "X-Evil" not in h and h["x-llmgw-replica"] == "spy-1"
    names = {line.split(b":")[0].lower() for line in got[0].split(b"\r\n")[1:] if line}
    assert b"authorization" not in names and b"cookie" not in names
    assert b"x-forwarded-for" not in names and b"x-request-id" in names
    assert b"sk-secret" not in got[0]
    assert b"\r\ncontent-type: application/json\r\n" in got[0].lower()
    await after(gw)


async def test_absurd_headers_are_refused_with_a_close(gw: Plane) -> None:
    body = json.dumps(CHAT).encode()
    for head in (
        b"X-Big: " + b"a" * 100_000 + b"\r\n",  # one header of 100 KB
        b"".join(b"X-H%d: 1\r\n" % i for i in range(1000)),  # a thousand headers
        b"X-" + b"n" * 20_000 + b": 1\r\n",  # a name of 20 KB
    ):
        answer = await raw(gw, _request(body, head=head))
        assert answer == b"" or _status(answer) in (400, 431), answer[:200]
    answer = await raw(gw, _request(body, path=b"/v1/" + b"p" * 20_000))
    assert answer == b"" or _status(answer) in (400, 414), answer[:200]
    await after(gw)


async def test_a_slow_client_is_closed_at_the_idle_timeout(
    js: Any, servers: Callable[..., Awaitable[Responder]]
) -> None:
    from services.gateway.server import Gateway

    g = Gateway(js, listen="127.0.0.1:0", idle_timeout_s=0.5)
    sock = g.bind()
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(g.run(stop, sock, on_ready=lambda _: ready.set()))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        host, port = g.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        # Slowloris: the request line and headers a byte at a time, never ending.
        t = time.monotonic()
        closed = False
        for b in _request(b"{}")[:-4]:
            try:
                writer.write(bytes([b]))
                await writer.drain()
            except ConnectionError:
                closed = True
                break
            with contextlib.suppress(TimeoutError):
                if await asyncio.wait_for(reader.read(1), 0.05) == b"":
                    closed = True
                    break
        writer.close()
        assert closed and time.monotonic() - t < 3.0
        async with aiohttp.ClientSession() as http, http.get(f"{g.url}/health") as r:
            assert r.status == 200
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_body_that_never_ends_is_408(gw: Plane) -> None:
    head = _request(b"x" * 1000)[: -1000 + 13]  # 13 of its 1,000 bytes
    answer = await raw(gw, head)
    assert _status(answer) == 408 and b"body_timeout" in answer
    await after(gw)


@pytest.mark.parametrize(
    "request_",
    [
        pytest.param(
            HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
            id="a chunk size that is not hex",
        ),
        pytest.param(
            HEAD + b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffffffff\r\n{}\r\n",
            id="a chunk size past 64 bits",
        ),
        pytest.param(
            HEAD + b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            id="Content-Length beside chunked (smuggling)",
        ),
        pytest.param(
            HEAD + b"Content-Length: 2\r\nContent-Length: 40\r\n\r\n{}",
            id="two Content-Lengths",
        ),
        pytest.param(
            HEAD + b"Transfer-Encoding: gzip, chunked"
            b"\r\nTransfer-Encoding: identity\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            id="a Transfer-Encoding that is not chunked last",
        ),
        pytest.param(
            HEAD + b"Content-Length: -5\r\n\r\n{}",
            id="a negative Content-Length",
        ),
        pytest.param(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, id="TLS"),
        pytest.param(b"GARBAGE / HTTP/9.9\r\n\r\n", id="not a method or a version"),
    ],
)
async def test_broken_framing_is_400_or_a_close(gw: Plane, request_: bytes) -> None:
    answer = await raw(gw, request_, within_s=3)
    assert answer == b"" or _status(answer) in (400, 501), answer[:300]
    await after(gw)


async def test_http_1_0_is_answered_and_closed(gw: Plane) -> None:
    body = json.dumps(CHAT).encode()
    answer = await raw(
        gw,
        b"POST /v1/chat/completions HTTP/1.0\r\n%sContent-Length: %d\r\n\r\n%s"
        % (JSON, len(body), body),
    )
    assert _status(answer) == 200 and b"x-llmgw-replica: " + gw.rid.encode() in answer  # type: ignore[attr-defined]
    await after(gw)


async def test_pipelined_requests_are_answered_in_order(gw: Plane) -> None:
    one = json.dumps({**CHAT, "user": "a"}).encode()
    bad = b"[1]"
    keep = HEAD + b"Content-Length: %d\r\n\r\n%s"
    data = keep % (len(one), one) + keep % (len(bad), bad) + _request(one)
    answer = await raw(gw, data)
    statuses = [int(x) for x in re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)]
    assert statuses == [200, 400, 200], answer[:500]
    await after(gw)


# ---------------------------------------------------------------- replicas that misbehave


async def test_a_replica_that_answers_garbage_is_502(gw: Plane) -> None:
    await gw.model("garbled")
    for i, answer in enumerate(
        (
            b"this is not HTTP\r\n\r\n",
            b'HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{"cut',  # ends early
            b"HTTP/1.1 200 OK\r\nContent-Length: zz\r\n\r\n{}",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nqq\r\n",
        )
    ):
        async with raw_server(answer) as url:
            await gw.ready(f"garbled-{i}", "garbled", url)
            status, h, body = await gw.chat("garbled")
            await gw.drain(f"garbled-{i}", "garbled")
        assert status == 502, (answer, body)
        _error(status, h, body, "bad_upstream")
    await after(gw)


async def test_an_answer_larger_than_one_read_comes_whole(
    gw: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    inputs = [f"text {i}" for i in range(3000)]
    direct = await servers(f"big-{gw.node}", MODEL)
    async with gw.http.post(
        f"{direct.endpoint}/v1/embeddings", json={"model": MODEL, "input": inputs}
    ) as r:
        whole = await r.read()
    assert len(whole) > 256 * 1024
    status, _, body = await gw.post("/v1/embeddings", {"model": MODEL, "input": inputs})
    assert status == 200 and len(body) == len(whole)
    assert len(json.loads(body)["data"]) == len(inputs)
    await after(gw)


async def test_a_replica_silent_before_its_answer_is_504(gw: Plane) -> None:
    await gw.model("silent")
    async with raw_server(None) as url:
        await gw.ready("silent-1", "silent", url)
        status, h, body = await gw.chat("silent")
    assert status == 504
    _error(status, h, body, "upstream_timeout")
    await after(gw)


@contextlib.asynccontextmanager
async def stalling_stream() -> AsyncIterator[str]:
    """A server that begins a stream, sends one event and then nothing, ever."""
    hold = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            event = b'data: {"choices": [{"text": "a"}]}\n\n'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event)
            )
            await writer.drain()
            await hold.wait()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        hold.set()
        for w in writers:
            w.close()
        server.close()
        await server.wait_closed()


async def test_a_replica_that_stalls_mid_stream_has_its_stream_cut(gw: Plane) -> None:
    await gw.model("stalls")
    async with stalling_stream() as url:
        await gw.ready("stalls-1", "stalls", url)
        body = {"model": "stalls", "prompt": "p", "stream": True}
        t = time.monotonic()
        async with gw.http.post(f"{gw.url}/v1/completions", json=body) as r:
            assert r.status == 200
            got = b""
            with contextlib.suppress(aiohttp.ClientPayloadError):
                async for chunk in r.content.iter_any():
                    got += chunk
        # The first event passed on; then, past the upstream timeout (1 s here), cut: no
        # [DONE], the client's read ends.
        assert got.startswith(b"data: ") and b"[DONE]" not in got
        assert 0.9 < time.monotonic() - t < 10
    await after(gw)


# ---------------------------------------------------------------- clients that go away


async def test_clients_gone_at_once_mid_stream_mid_body_and_mid_wait_leave_nothing_behind(
    gw: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await gw.model("crowd", target_inflight=25)  # fifty in flight at once
    slow = await servers("crowd-1", "crowd", Timing(0.0, 50.0))
    await gw.ready("crowd-1", "crowd", slow.endpoint)
    streams = []
    for _ in range(30):
        r = await gw.http.post(
            f"{gw.url}/v1/completions",
            json={"model": "crowd", "prompt": "p", "stream": True, "max_tokens": 500},
        )
        await r.content.readany()
        streams.append(r)
    # Waiting for a whole answer that takes seconds (not streamed).
    waiting = [
        asyncio.create_task(
            gw.http.post(
                f"{gw.url}/v1/completions",
                json={"model": "crowd", "prompt": "p", "max_tokens": 500},
            )
        )
        for _ in range(10)
    ]
    # Half-way through sending a body.
    halves = []
    for _ in range(10):
        _, writer = await asyncio.open_connection(*_addr(gw))
        writer.write(_request(b'{"model": "crowd", "prompt": "' + b"x" * 500)[:-250])
        halves.append(writer)

    async def inflight() -> int:
        return sum(gw.gateway.router.inflight.values())

    await wait_for(inflight, lambda n: n == 40, 5)
    for r in streams:
        r.close()
    for t in waiting:
        t.cancel()
    for w in halves:
        w.close()
    await asyncio.gather(*waiting, return_exceptions=True)

    async def counts() -> tuple[dict[str, int], int]:
        return dict(gw.gateway.router.inflight), slow.active

    await wait_for(counts, lambda c: c == ({}, 0), 5)
    await after(gw)
