"""The lean server (`--server lean`, `services.gateway.front`) is aiohttp's
(`--server aiohttp`, the reference) to the gateway's clients: two gateways follow the
same log, one on each server, in front of the same scripted replica
(tests/gateway/test_upstream_client.py's), and the same requests get the same answers:
the same status, the same headers but Date, Server and the view's seq, the same body
(a streamed one, unchunked) and the same connection kept or closed. Good requests go
through the official `openai` client and as raw bytes; hostile ones (invalid JSON, an
oversized body, a wrong Content-Length, a body that never ends, a client gone
mid-stream, pipelined requests, a bad request line, huge headers, broken framing) as
raw bytes. After each, both gateways still answer, and nothing is left in flight.

A request HTTP itself cannot parse is 400 and closed on both; its body is the parser's
words (aiohttp quotes the bytes it read, the lean server does not), so there the status
and the close are compared, not the words."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import json
import logging
import re
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any
from unittest.mock import patch

import httptools
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from openai import AsyncOpenAI

from services.gateway.exchange import Whole
from services.gateway.front import HIGH_WATER, BadBody, Front, Request, Stream
from services.gateway.guard import Budget, Lines
from services.gateway.loop import loop_factory
from services.gateway.request import read_body
from services.gateway.server import Gateway
from tests.agent.helpers import wait_for
from tests.gateway.conftest import Plane, gateway_for
from tests.gateway.test_upstream_client import Replica, side_by_side

pytestmark = [pytest.mark.timeout(60), pytest.mark.module_broker]

# LEFT_OUT are the headers that may differ between the two servers.
LEFT_OUT = ("date", "server", "x-llmgw-seq")


class Two:
    """The two gateways, the replica, and a model of each script's name."""

    def __init__(self, plane: Plane, lean: Gateway, rep: Replica) -> None:
        self.plane = plane
        self.ref = plane.gateway
        self.lean = lean
        self.rep = rep

    def model(self, script: str) -> str:
        return f"{script}-{self.plane.node}"

    def both(self) -> tuple[Gateway, Gateway]:
        return self.ref, self.lean


@pytest.fixture(params=["compiled", "python"])
async def two(nc: Client, js: JetStreamContext, request: Any) -> AsyncIterator[Two]:
    """The reference and the lean server, the lean one with its header callback and its
    answers' heads compiled (`--chunk-relay compiled`, the default where built) and with
    the rules in Python (tests/gateway/test_heads.py holds the two equal)."""
    ref = gateway_for(js, nc=nc, server="aiohttp")
    lean = gateway_for(js, nc=nc, server="lean", chunk_relay=request.param)
    for gw in (ref, lean):
        gw.body_timeout_s = 0.5
    scripts = ("whole", "stream", "stream-stall", "big", "e500")
    async with side_by_side(js, ref, lean, scripts) as (plane, rep):
        yield Two(plane, lean, rep)
        for gw in (ref, lean):
            await up(plane, gw, f"whole-{plane.node}")


def _addr(gw: Gateway) -> tuple[str, int]:
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def up(plane: Plane, gw: Gateway, model: str) -> None:
    """`gw` answers, and has nothing in flight."""

    async def state() -> tuple[int, dict[str, int], float]:
        async with plane.http.get(f"{gw.url}/health") as r:
            status, health = r.status, await r.json()
        async with plane.http.get(f"{gw.url}/metrics") as r:
            lines = (await r.text()).splitlines()
        gauge = sum(
            float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("llmgw_gateway_inflight{")
        )
        return status, health["inflight"], gauge

    await wait_for(state, lambda s: s == (200, {}, 0.0), 5)
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    async with plane.http.post(f"{gw.url}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.read()


class Answers:
    """The answers in what came back on one connection, parsed (httptools); `closed`:
    the server closed it."""

    def __init__(self, data: bytes, closed: bool) -> None:
        self.closed = closed
        self.got: list[tuple[int, list[tuple[str, str]], bytes]] = []
        head, _, _ = data.partition(b"\r\n\r\n")
        self.head = [
            (k.strip().lower(), v.strip())
            for k, _, v in (line.decode().partition(":") for line in head.split(b"\r\n")[1:])
        ]
        self._headers: list[tuple[str, str]] = []
        self._body = b""
        parser = httptools.HttpResponseParser(self)
        self._parser = parser
        self._open = False
        with contextlib.suppress(httptools.HttpParserError):
            parser.feed_data(data)
        if self._open and closed:
            # An answer that runs to the connection's end (HTTP/1.0's stream).
            self.on_message_complete()

    def on_headers_complete(self) -> None:
        self._open = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.decode().lower() not in LEFT_OUT:
            self._headers.append((name.decode().lower(), value.decode()))

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self._open = False
        status = self._parser.get_status_code()
        if status != 100:
            # `transfer-encoding` and `connection: keep-alive` say how it was framed,
            # compared as `closed`.
            headers = sorted(h for h in self._headers if h[0] != "transfer-encoding")
            self.got.append((status, headers, self._body))
        self._headers, self._body = [], b""

    def statuses(self) -> list[int]:
        return [s for s, _, _ in self.got]


async def raw(gw: Gateway, data: bytes | list[bytes], *, within_s: float = 5.0) -> Answers:
    """`data` sent on a connection of its own (a list: in separate writes); what came
    back until the server closed it or `within_s` passed."""
    reader, writer = await asyncio.open_connection(*_addr(gw))
    got = b""
    closed = False
    try:
        for part in [data] if isinstance(data, bytes) else data:
            writer.write(part)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                while True:
                    try:
                        chunk = await reader.read(65536)
                    except ConnectionError:
                        chunk = b""
                    if not chunk:
                        closed = True
                        break
                    got += chunk
        return Answers(got, closed)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def both(two: Two, data: bytes | list[bytes], within_s: float = 5.0) -> Answers:
    """`data` to each gateway; the two answers the same (status, headers but those that
    may differ, body, the connection closed or kept); the lean one's."""
    a = await raw(two.ref, data, within_s=within_s)
    b = await raw(two.lean, data, within_s=within_s)
    assert a.got, "the reference gave no answer"
    assert a.got == b.got
    assert a.closed == b.closed
    return b


JSON = b"Content-Type: application/json\r\n"
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + JSON


def chat(model: str, **extra: Any) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    ).encode()


def post(body: bytes, *, head: bytes = b"", close: bool = True, path: bytes = b"") -> bytes:
    line = b"POST " + (path or b"/v1/chat/completions") + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    return (
        line + (b"Connection: close\r\n" if close else b"") + JSON + head
        + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip


# ---------------------------------------------------------------- good requests


async def test_the_openai_client_gets_the_same_from_both(two: Two) -> None:
    got = []
    for gw in two.both():
        client = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=10)
        whole = await client.chat.completions.create(
            model=two.model("whole"), messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        events = await client.chat.completions.create(
            model=two.model("stream"),
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c.model_dump() async for c in events]
        models = await client.models.list()
        seen = sorted(m.id for m in models.data if m.id.endswith(two.plane.node))
        got.append((whole.model_dump(), chunks, seen))
        await client.close()
    assert got[0] == got[1]
    assert got[0][0]["choices"][0]["message"]["content"] == "a b c"
    assert "".join(c["choices"][0]["delta"]["content"] for c in got[0][1] if c["choices"]) == (
        "a b c"
    )


@pytest.mark.parametrize(
    "script", ["whole", "stream", "big", "e500"], ids=["whole", "stream", "big", "e500"]
)
@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
async def test_an_answer_is_the_same_bytes_from_both(two: Two, script: str, stream: bool) -> None:
    a = await both(two, post(chat(two.model(script), stream=stream)))
    assert a.closed and len(a.got) == 1


async def test_a_whole_answer_is_sent_before_it_is_counted_on_both(
    two: Two, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client waits for none of the gateway's counting of its answer: sent whole
    first, it is counted after. A count that fails (made to here) finds the answer sent,
    whole and 200, not turned into a 500 (the gateway says the error and closes)."""
    counted: list[int] = []

    def broken(r: Any, tokens_in: int, tokens_out: int, *rest: Any) -> None:
        counted.append(tokens_out)
        raise RuntimeError("the count broke")

    for gw in two.both():
        counted.clear()
        monkeypatch.setattr(gw.forwarder, "used", broken)
        a = await raw(gw, post(chat(two.model("whole"), max_tokens=3)))
        assert [(status, body) for status, _, body in a.got] == [
            (200, a.got[0][2])
        ] and b'"a b c"' in a.got[0][2], a.got
        assert a.closed and counted == [3]


async def test_keep_alive_and_the_pages_are_the_same(two: Two) -> None:
    body = chat(two.model("whole"))
    requests = [
        post(body, close=False),
        post(chat(two.model("stream"), stream=True), close=False),
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: evil.example\r\n" + JSON + b"Content-Length: 2"
        b"\r\n\r\n{}",
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body),
        HEAD + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
        post(body),
    ]
    a = await both(two, requests)
    assert a.statuses() == [200, 200, 200, 404, 405, 415, 415, 421, 200, 200, 200]
    assert a.closed
    # HEAD: GET's headers (its Content-Length), no body.
    heads = []
    for gw in two.both():
        for path in (b"/v1/models", b"/v1/chat/completions"):
            got = await raw(gw, b"HEAD %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" % path, within_s=1)
            heads.append(sorted(h for h in got.head if h[0] not in LEFT_OUT))
    assert heads[:2] == heads[2:] and ("x-llmgw-reason", "method_not_allowed") in heads[1]
    # /health and /metrics: the same shape (their figures are each gateway's own).
    for page in ("/health", "/metrics"):
        pages = []
        for gw in two.both():
            async with two.plane.http.get(f"{gw.url}{page}") as r:
                pages.append((r.status, r.headers["Content-Type"]))
        assert pages[0] == pages[1] and pages[0][0] == 200


async def test_http_1_0_is_answered_and_closed_the_same(two: Two) -> None:
    body = chat(two.model("whole"))
    for keep in (b"", b"Connection: keep-alive\r\n"):
        a = await both(
            two,
            b"POST /v1/chat/completions HTTP/1.0\r\n%s%sContent-Length: %d\r\n\r\n%s"
            % (keep, JSON, len(body), body),
            within_s=1.0,
        )
        assert a.statuses() == [200] and a.closed == (keep == b"")
    stream = chat(two.model("stream"), stream=True)
    a = await both(
        two,
        b"POST /v1/chat/completions HTTP/1.0\r\n%sContent-Length: %d\r\n\r\n%s"
        % (JSON, len(stream), stream),
    )
    assert a.statuses() == [200] and a.closed and a.got[0][2].endswith(b"data: [DONE]\n\n")


# ---------------------------------------------------------------- hostile requests


@pytest.mark.parametrize(
    ("body", "status"),
    [
        pytest.param(b'{"model": "x", "messages": [', 400, id="truncated JSON"),
        pytest.param(b"[1, 2]", 400, id="a JSON array"),
        pytest.param(b"\xff\xfe", 400, id="not UTF-8"),
        pytest.param(b'{"model": "nobody"}', 404, id="an unknown model"),
        pytest.param(b'{"model": "m", "stream": "yes"}', 400, id="a stream that is no boolean"),
    ],
)
async def test_an_invalid_body_is_refused_the_same(two: Two, body: bytes, status: int) -> None:
    a = await both(two, post(body))
    assert a.statuses() == [status]


async def test_an_oversized_body_is_413_the_same(two: Two) -> None:
    big = b'{"model": "' + b"x" * 200_000 + b'"}'
    a = await both(two, post(big, close=False), within_s=1.0)
    assert a.statuses() == [413]
    # With Connection: close, and a body still coming as it is answered: its rest is
    # read (dropped) before the close, or the close would reset the answer away.
    huge = b'{"model": "' + b"x" * (8 << 20) + b'"}'
    a = await both(two, post(huge, close=True))
    assert a.statuses() == [413] and a.closed
    # Said chunked, it is read up to the limit.
    a = await both(two, HEAD + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        len(big), big))  # fmt: skip
    assert a.statuses() == [413]


async def test_a_wrong_content_length_is_answered_the_same(two: Two) -> None:
    body = chat(two.model("whole"))
    # Longer than the body: it never ends (408). Shorter: the rest is the next request.
    a = await both(
        two, HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body) + 10, body), within_s=1.5
    )
    assert a.statuses() == [408]
    data = HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body) - 10, body)
    a = await raw(two.ref, data)
    b = await raw(two.lean, data)
    # What differs (test_a_bad_request_after_a_good_one_is_answered_after_it): aiohttp's
    # parser drops the cut body's request with what follows it; the lean server answers
    # it (the body is not JSON), then 400 for what follows.
    assert a.statuses()[-1] == b.statuses()[-1] == 400 and a.closed and b.closed
    assert b.statuses() == [400, 400] and b"invalid_json" in b.got[0][2]


async def test_a_body_that_never_completes_is_408_the_same(two: Two) -> None:
    a = await both(two, HEAD + b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"mod', within_s=1.5)
    assert a.statuses() == [408]


async def test_pipelined_requests_are_answered_in_order_the_same(two: Two) -> None:
    one = chat(two.model("whole"), user="a")
    keep = HEAD + b"Content-Length: %d\r\n\r\n%s"
    s = chat(two.model("stream"), stream=True)
    data = keep % (len(one), one) + keep % (3, b"[1]") + keep % (len(s), s) + post(one)
    a = await both(two, data)
    assert a.statuses() == [200, 400, 200, 200] and a.closed


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"GARBAGE / HTTP/9.9\r\n\r\n", id="not a method or a version"),
        pytest.param(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, id="TLS"),
        pytest.param(HEAD + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n", id="a header of 100 KB"),
        pytest.param(HEAD + b"X-Big: " + b"a" * 8191 + b"\r\n\r\n", id="a header of 8,191 bytes"),
        pytest.param(
            HEAD + b"".join(b"X-H%d: 1\r\n" % i for i in range(1000)) + b"\r\n",
            id="a thousand headers",
        ),
        pytest.param(HEAD + b"X-" + b"n" * 20_000 + b": 1\r\n\r\n", id="a header name of 20 KB"),
        pytest.param(
            b"GET /" + b"p" * 20_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", id="a 20 KB path"
        ),
        pytest.param(HEAD + b"Bad Header: x\r\n\r\n", id="a space in a header name"),
        pytest.param(HEAD + b"X-A: a\rb\r\n\r\n", id="a bare CR in a header"),
        pytest.param(
            HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", id="a bad chunk size"
        ),
        pytest.param(
            HEAD + b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            id="Content-Length beside chunked",
        ),
        pytest.param(
            HEAD + b"Content-Length: 2\r\nContent-Length: 40\r\n\r\n{}", id="two Content-Lengths"
        ),
        pytest.param(HEAD + b"Content-Length: -5\r\n\r\n{}", id="a negative Content-Length"),
    ],
)
async def test_what_http_cannot_parse_is_400_and_closed_on_both(two: Two, data: bytes) -> None:
    a = await raw(two.ref, data, within_s=3)
    b = await raw(two.lean, data, within_s=3)
    assert a.statuses() == b.statuses() == [400], (a.got, b.got)
    assert a.closed and b.closed


async def test_a_bad_request_after_a_good_one_is_answered_after_it(two: Two) -> None:
    """Where the two differ: a request HTTP cannot parse pipelined behind a good one
    in the same packet. aiohttp's parser drops the good one with the bad (one 400); the
    lean server answers the good one, then 400, and closes."""
    one = chat(two.model("whole"))
    data = HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(one), one) + b"GARBAGE\r\n\r\n"
    a = await raw(two.ref, data)
    b = await raw(two.lean, data)
    assert a.statuses()[-1] == 400 and a.closed
    assert b.statuses() == [200, 400] and b.closed
    # After the good one's answer, the two are answered the same.
    good = await both(
        two, data[: -len(b"GARBAGE\r\n\r\n")].replace(HEAD, HEAD + b"Connection: close\r\n")
    )
    assert good.statuses() == [200]


async def test_a_client_gone_mid_stream_is_counted_the_same(two: Two) -> None:
    """A stream that stalls after its first event; its client reads that and goes. Each
    gateway cancels it, frees its slot and counts it as 499."""
    body = chat(two.model("stream-stall"), stream=True)
    counted = []
    for gw in two.both():
        reader, writer = await asyncio.open_connection(*_addr(gw))
        writer.write(post(body, close=False))
        got = b""
        while b"data: " not in got:
            got += await asyncio.wait_for(reader.read(65536), 5)
        writer.close()

        async def gone(gw: Gateway = gw) -> dict[str, int]:
            return dict(gw.router.inflight)

        await wait_for(gone, lambda n: not n, 5)
        metrics = gw.metrics.render().decode()
        counted.append(
            re.findall(r'llmgw_gateway_requests_total\{[^}]*status="499"[^}]*\} (\S+)', metrics)
        )
    assert counted[0] == counted[1] and counted[0] == ["1.0"]


@contextlib.asynccontextmanager
async def front(handler: Any) -> AsyncIterator[tuple[Front, tuple[str, int]]]:
    """A lean server of its own on loopback, answering with `handler`."""
    import socket

    server = Front(handler, Lines(logging.getLogger("test")), idle_timeout_s=30)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    await server.start(sock)
    try:
        yield server, sock.getsockname()
    finally:
        await server.stop()


# LOOPS: the lean server's own tests run on both loops a gateway may run on (the
# gateway's tests above run on the tests' loop, asyncio's).
LOOPS = ["asyncio", *(["uvloop"] if importlib.util.find_spec("uvloop") else [])]


def on(loop: str, test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        runner.run(test())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_that_does_not_read_holds_its_stream_not_memory(loop: str) -> None:
    on(loop, _a_client_that_does_not_read)


async def _a_client_that_does_not_read() -> None:
    """A stream of 64 MiB to a client that reads nothing: the writes wait for it (what
    the server holds stays bounded), and it gets the whole stream once it reads."""
    written = [0]
    held: list[int] = []
    blocked = asyncio.Event()

    async def handler(request: Request) -> Stream:
        out = await request.begin(200, {"Content-Type": "text/event-stream"})
        chunk = b"x" * 65536
        for _ in range(1024):
            write = asyncio.ensure_future(out.write(chunk))
            done, _ = await asyncio.wait([write], timeout=0.2)
            if not done:
                assert request.transport is not None
                held.append(request.transport.get_write_buffer_size())
                blocked.set()
                await write
            written[0] += len(chunk)
        await out.write_eof()
        return out

    async with front(handler) as (_, addr):
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(blocked.wait(), 10)
        assert written[0] < 16 << 20 and held[0] < 4 << 20
        got = 0
        while chunk := await asyncio.wait_for(reader.read(1 << 20), 10):
            got += len(chunk)
            if got >= 64 << 20:
                break
        writer.close()
    assert written[0] == 64 << 20 and got >= 64 << 20


@pytest.mark.parametrize("loop", LOOPS)
def test_a_body_its_handler_does_not_take_stops_the_reading(loop: str) -> None:
    on(loop, _a_body_not_taken)


async def _a_body_not_taken() -> None:
    """A body sent faster than its handler takes it: the connection stops reading past
    HIGH_WATER (the server holds that, not the body), and reads on as it is taken."""
    took = asyncio.Event()
    go = asyncio.Event()
    seen: list[int] = []

    async def handler(request: Request) -> Whole:
        took.set()
        await go.wait()
        size = 0
        while chunk := await request.content.readany():
            seen.append(request._size)
            size += len(chunk)
        return Whole(b"%d" % size)

    async with front(handler) as (_, addr):
        reader, writer = await asyncio.open_connection(*addr)
        n = 32 << 20
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % n)
        await asyncio.wait_for(took.wait(), 5)
        part = b"y" * (1 << 20)
        sent = 0

        async def send() -> None:
            nonlocal sent
            for _ in range(32):
                writer.write(part)
                await writer.drain()
                sent += len(part)

        sending = asyncio.create_task(send())
        done, _ = await asyncio.wait([sending], timeout=1.0)
        assert not done and sent < 16 << 20  # the server stopped reading
        go.set()
        await asyncio.wait_for(sending, 10)
        answer = await asyncio.wait_for(reader.readuntil(b"%d" % n), 10)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert max(seen) < HIGH_WATER + (1 << 20)


@pytest.mark.parametrize("loop", LOOPS)
def test_the_lean_server_on_each_loop_answers_and_refuses(loop: str) -> None:
    on(loop, _answers_and_refuses)


async def _answers_and_refuses() -> None:
    """Keep-alive, pipelining, a stream, HTTP/1.0, a handler that fails (500, closed), a
    client gone mid-stream (its handler cancelled), what HTTP cannot parse (400,
    closed): the server answers each, and the next connection."""
    cancelled = asyncio.Event()

    async def handler(request: Request) -> Whole | Stream:
        if request.path == "/fail":
            raise RuntimeError("a handler's bug")
        if request.path == "/stream":
            out = await request.begin(200, {"Content-Type": "text/event-stream"})
            await out.write(b"data: 1\n\n")
            if request.headers.get("X-Hold"):
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    cancelled.set()
                    raise
            await out.write_eof()
            return out
        body = b""
        while chunk := await request.content.readany():
            body += chunk
        return Whole(b"%s %s %d" % (request.method.encode(), request.path.encode(), len(body)))

    async with front(handler) as (_, addr):

        async def ask(data: bytes) -> Answers:
            reader, writer = await asyncio.open_connection(*addr)
            writer.write(data)
            got = b""
            with contextlib.suppress(TimeoutError, ConnectionError):
                async with asyncio.timeout(2):
                    while chunk := await reader.read(65536):
                        got += chunk
            closed = reader.at_eof()
            writer.close()
            return Answers(got, closed)

        get = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
        got = await ask(
            get
            + b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
            + b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
            + b"GET /c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert [(s, b) for s, _, b in got.got] == [
            (200, b"GET /a 0"),
            (200, b"POST /b 3"),
            (200, b"data: 1\n\n"),
            (200, b"GET /c 0"),
        ] and got.closed
        got = await ask(b"GET /d HTTP/1.0\r\n\r\n")
        assert [(s, b) for s, _, b in got.got] == [(200, b"GET /d 0")] and got.closed
        got = await ask(get.replace(b"/a", b"/fail") + get)
        assert got.statuses() == [500] and got.closed
        got = await ask(get + b"NOT HTTP\r\n\r\n")
        assert got.statuses() == [200, 400] and got.closed
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\nX-Hold: 1\r\n\r\n")
        await reader.readuntil(b"data: 1")
        writer.close()
        await asyncio.wait_for(cancelled.wait(), 5)
        got = await ask(get.replace(b"HTTP/1.1", b"HTTP/1.1\r\nConnection: close"))
        assert got.statuses() == [200]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_body_that_came_with_its_head_is_taken_without_a_wait(loop: str) -> None:
    on(loop, _a_body_with_its_head)


async def _a_body_with_its_head() -> None:
    """A request sent whole in one write (most clients' small requests): its body has
    ended when its handler starts, as aiohttp's `is_eof` says, so `read_body` takes it
    with `read_nowait` and arms no timer for it; one whose body comes later is read as
    it comes; one whose connection broke raises from `read_nowait`."""
    seen: list[tuple[bool, bytes]] = []
    budget = Budget(1 << 20)

    async def handler(request: Request) -> Whole:
        ended = request.content.is_eof()
        with patch.object(asyncio, "timeout", side_effect=AssertionError("a timer")):
            if ended:
                body = await read_body(request, 1 << 20, budget, 5)
        if not ended:
            body = await read_body(request, 1 << 20, budget, 5)
        seen.append((ended, body))
        return Whole(body)

    body = b'{"model": "m"}'
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
    async with front(handler) as (_, addr):
        reader, writer = await asyncio.open_connection(*addr)
        for _ in range(2):
            writer.write(head % len(body) + body)
            await reader.readuntil(body)
        writer.write(head % len(body))
        await writer.drain()
        await asyncio.sleep(0)  # the head alone first, as a client may send it
        writer.write(body)
        await reader.readuntil(body)
        writer.close()
    assert seen[:2] == [(True, body), (True, body)]
    assert seen[2][1] == body
    assert budget.held == 3 * len(body)  # each body's bytes held (the gateway gives them back)

    request = Request.__new__(Request)
    request._chunks, request._eof, request._error = deque([b"x"]), True, BadBody("broken")
    assert request.is_eof()
    with pytest.raises(BadBody):
        request.read_nowait()


def test_a_streams_last_chunk_and_its_end_are_one_write() -> None:
    on("asyncio", _last_chunk_and_end)


async def _last_chunk_and_end() -> None:
    """`write_eof(data)` sends the stream's last chunk and the end of its chunks in one
    write (a continued stream's last events, its `[DONE]` and its end: one write where
    there were three); the client reads the same bytes. Counted on asyncio's transport,
    whose `write` is Python's to wrap."""
    import asyncio.selector_events

    # Private to asyncio (and to its stubs): looked up, not imported.
    transport: Any = vars(asyncio.selector_events)["_SelectorSocketTransport"]
    writes: list[bytes] = []
    real = transport.write

    def counted(self: Any, data: Any) -> None:
        writes.append(bytes(data))
        real(self, data)

    async def handler(request: Request) -> Stream:
        out = await request.begin(200, {"Content-Type": "text/event-stream"})
        writes.clear()
        await out.write(b"data: 1\n\n")
        await out.write_eof(b"data: 2\n\ndata: [DONE]\n\n")
        return out

    with patch.object(transport, "write", counted):
        async with front(handler) as (_, addr):
            reader, writer = await asyncio.open_connection(*addr)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            got = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
            writer.close()
    last = b"data: 2\n\ndata: [DONE]\n\n"
    end = b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last)
    assert got.partition(b"\r\n\r\n")[2] == b"9\r\ndata: 1\n\n\r\n" + end
    assert writes == [b"9\r\ndata: 1\n\n\r\n", end]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connections_requests_are_served_by_one_task(loop: str) -> None:
    on(loop, _one_task_a_connection)


async def _one_task_a_connection() -> None:
    """A connection's requests, one after another or pipelined, are served by one task,
    not a task each (made, registered and dropped for each request); it waits between
    them, and ends as its connection closes."""
    tasks: list[asyncio.Task[Any] | None] = []
    kept: list[weakref.ref[Any]] = []

    class Kept:
        """Something kept on a request while it is served."""

    async def handler(request: Request) -> Whole:
        tasks.append(asyncio.current_task())
        request["kept"] = k = Kept()
        kept.append(weakref.ref(k))
        return Whole(request.path.encode())

    get = b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n"
    async with front(handler) as (_, addr):
        before = asyncio.all_tasks()
        reader, writer = await asyncio.open_connection(*addr)
        for i in range(3):
            writer.write(get % i)
            await reader.readuntil(b"/%d" % i)
        writer.write(get % 3 + get % 4)  # pipelined
        await reader.readuntil(b"/4")
        assert len(tasks) == 5 and len(set(map(id, tasks))) == 1
        task = tasks[0]
        assert task is not None and not task.done()  # waiting for the next request
        # What was kept on the requests is not held while the connection waits.
        await asyncio.sleep(0)
        gc.collect()
        assert [k() for k in kept] == [None] * 5
        writer.close()
        await asyncio.wait_for(asyncio.wait([task]), 5)
        assert asyncio.all_tasks() == before
        # Another connection, a task of its own.
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(get % 5)
        await reader.readuntil(b"/5")
        writer.close()
    assert len(tasks) == 6 and tasks[5] is not task


async def test_a_header_of_the_longest_length_taken_is_served_on_both(two: Two) -> None:
    """A header's value of MAX_FIELD bytes exactly is taken by both; one byte more is 400
    (`test_what_http_cannot_parse_is_400_and_closed_on_both`), however the head is read."""
    one = chat(two.model("whole"))
    data = post(one, head=b"X-Big: " + b"a" * 8190 + b"\r\n")
    a = await both(two, data)
    assert a.statuses() == [200] and a.closed
    for gw in two.both():
        # The head a few bytes a read: its size is counted over the reads.
        reader, writer = await asyncio.open_connection(*_addr(gw))
        over = post(one, head=b"X-Big: " + b"a" * 8191 + b"\r\n")
        for i in range(0, len(over), 1000):
            writer.write(over[i : i + 1000])
            await writer.drain()
            await asyncio.sleep(0.001)
        line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert line.split(b" ")[1] == b"400", (gw.server, line)
