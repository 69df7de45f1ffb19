"""The lean upstream client (`--upstream-client lean`, `services.gateway.upstream`) is
aiohttp's (`--upstream-client aiohttp`, the reference) to the gateway's clients: two
gateways follow the same log, one on each, in front of the same scripted replica, and
every answer the replica can give (whole, chunked, ended by its connection, large,
streamed in odd pieces, cut, stalled, a 500, a 503, garbage, silence, a refused
connection, `Connection: close`) reaches the client as the same status, headers and
bytes, is counted as the same use, and the replica is asked the same request (the same
headers, the same body). With continuation on and off (a stream's two paths through the
forwarder). The lean client keeps its connections alive between requests, and its body's
sink (the fast path's: each read taken in the callback that read it) hands on each read
until it stops, then keeps them for the reader, and wakes it at a break."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiohttp
import pytest
import yarl
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from openai import AsyncOpenAI

from services.gateway import relay
from services.gateway.server import Gateway
from services.gateway.upstream import LeanSession
from tests.agent.helpers import wait_for
from tests.gateway.conftest import Plane, gateway_for, serving

pytestmark = pytest.mark.timeout(90)

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
WHOLE = json.dumps(
    {
        "id": "cmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "a b c"},
                "finish_reason": "length",
            }
        ],
        "usage": USAGE,
    }
).encode()


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _chunk(text: str, usage: bool = False) -> bytes:
    doc: dict[str, Any] = {
        "id": "cmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
    }
    if usage:
        doc |= {"choices": [], "usage": USAGE}
    else:
        doc["choices"] = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
    return _event(doc)


EVENTS = _chunk("a") + _chunk(" b") + _chunk(" c") + _chunk("", usage=True) + b"data: [DONE]\n\n"
SSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunked(*parts: bytes) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in parts]


def _whole(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
        % (status.encode(), len(body), extra)
    ) + body


BIG = json.dumps({**json.loads(WHOLE), "pad": "x" * 400_000}).encode()
JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"

# SCRIPTS: what the replica of each model answers: the writes (a float: a pause of that
# many seconds; None: silence until the test ends), then whether it closes.
SCRIPTS: dict[str, tuple[list[bytes | float | None], bool]] = {
    "whole": ([_whole(WHOLE)], False),
    "whole-split": ([_whole(WHOLE)[:50], 0.02, _whole(WHOLE)[50:]], False),
    # Headers said twice (the same name, and in another case), after an interim head
    # with one of its own: the client is passed the first of each, on both.
    "twice": (
        [
            b"HTTP/1.1 100 Continue\r\nX-Request-Id: interim\r\n\r\n"
            + _whole(
                WHOLE,
                extra=b"Cache-Control: no-store\r\nCache-Control: max-age=5\r\n"
                b"X-Request-Id: a\r\nx-request-id: b\r\n",
            )
        ],
        False,
    ),
    "chunked": (
        [
            JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\n",
            *_chunked(WHOLE[:40], WHOLE[40:]),
            b"0\r\n\r\n",
        ],
        False,
    ),
    "eof": ([JSON_HEAD + b"Connection: close\r\n\r\n" + WHOLE], True),
    "close": ([_whole(WHOLE, extra=b"Connection: close\r\n")], True),
    "big": ([_whole(BIG)[:70_000], 0.02, _whole(BIG)[70_000:]], False),
    "stream": (
        [SSE, *_chunked(EVENTS[:30], EVENTS[30:200]), 0.02, *_chunked(EVENTS[200:]), b"0\r\n\r\n"],
        False,
    ),
    "stream-cut": ([SSE, *_chunked(_chunk("a"), _chunk(" b"))], True),
    "stream-stall": ([SSE, *_chunked(_chunk("a")), None], False),
    "e500": (
        [
            _whole(
                b'{"error": {"message": "boom", "type": "server_error"}}',
                "500 Internal Server Error",
            )
        ],
        False,
    ),
    "e503": ([_whole(b'{"error": {"message": "busy"}}', "503 Service Unavailable")], False),
    "garbage": ([b"this is not HTTP\r\n\r\n"], True),
    "silent": ([None], False),
}


class Replica:
    """A scripted replica: answers each request with its model's script, on keep-alive
    connections; keeps each request as it came (head and body) and counts connections."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, dict[str, str], bytes]] = []
        self.connections = 0
        self.silence = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(Exception):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {}
                for line in lines[1:]:
                    if line:
                        k, _, v = line.partition(":")
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.asked.append((lines[0], headers, body))
                writes, close = SCRIPTS[json.loads(body)["model"].rsplit("-gw-", 1)[0]]
                for w in writes:
                    if w is None:
                        await self.silence.wait()
                    elif isinstance(w, float):
                        await writer.drain()
                        await asyncio.sleep(w)
                    else:
                        writer.write(w)
                await writer.drain()
                if close:
                    break
        writer.close()


@contextlib.asynccontextmanager
async def replica() -> AsyncIterator[tuple[Replica, str]]:
    rep = Replica()
    server = await asyncio.start_server(rep.handle, "127.0.0.1", 0)
    try:
        yield rep, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        rep.silence.set()
        for w in rep.writers:
            w.close()
        server.close()
        await server.wait_closed()


def _refused() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextlib.asynccontextmanager
async def side_by_side(
    js: JetStreamContext, ref: Gateway, lean: Gateway, models: Iterable[str]
) -> AsyncIterator[tuple[Plane, Replica]]:
    """`ref` (the plane's gateway) and `lean` serving, both following the log, the
    scripted replica ready for each of `models` (`refused` at a closed port)."""
    async with (
        serving(ref),
        serving(lean),
        aiohttp.ClientSession() as http,
        replica() as (rep, url),
    ):
        plane = Plane(js, ref, http)
        await plane.inventory(plane.node, 16)
        for model in models:
            name = f"{model}-{plane.node}"
            await plane.model(name)
            await plane.ready(f"{name}-1", name, _refused() if model == "refused" else url)
        await lean.follower.wait_for(ref.follower.seq, 5)
        yield plane, rep


@contextlib.asynccontextmanager
async def two(
    nc: Client, js: JetStreamContext, continuation_limit: int, chunk_relay: str = "auto"
) -> AsyncIterator[tuple[Plane, Gateway, Replica]]:
    """The aiohttp gateway (the plane's) and the lean one, both following the log, the
    scripted replica ready for every model of SCRIPTS and `refused` at a closed port. The
    lean one's read callbacks are compiled with `--chunk-relay compiled` (and `auto`,
    where it was built), its own with `python`."""
    ref = gateway_for(js, nc=nc, upstream_client="aiohttp", continuation_limit=continuation_limit)
    lean = gateway_for(
        js,
        nc=nc,
        upstream_client="lean",
        continuation_limit=continuation_limit,
        chunk_relay=chunk_relay,
    )
    assert (lean.forwarder.readers is None) == (chunk_relay == "python")
    async with side_by_side(js, ref, lean, [*SCRIPTS, "refused"]) as (plane, rep):
        yield plane, lean, rep


def _recorded(gw: Gateway) -> list[tuple[str, int, int, int | None]]:
    """What `gw` counts as used, call by call: (replica, tokens in, tokens out, cached)."""
    got: list[tuple[str, int, int, int | None]] = []
    used = gw.uses.used

    def record(r: Any, tokens_in: int, tokens_out: int, key: Any, cached: Any, *rest: Any) -> None:
        got.append((r.id, tokens_in, tokens_out, cached))
        used(r, tokens_in, tokens_out, key, cached, *rest)

    gw.uses.used = record  # type: ignore[method-assign,assignment]
    return got


async def _ask(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[Any, ...]:
    """Status, headers but Date and x-llmgw-seq (the view's seq, which the gateways' own
    use reports move), and the bytes the client got (and whether the stream was
    cut)."""
    got = b""
    cut = False
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        try:
            async for chunk in r.content.iter_any():
                got += chunk
        except aiohttp.ClientPayloadError:
            cut = True
        headers = sorted((k, v) for k, v in r.headers.items() if k not in ("Date", "x-llmgw-seq"))
        return r.status, headers, got, cut


@pytest.mark.parametrize("chunk_relay", ["compiled", "python"])
@pytest.mark.parametrize("continuation_limit", [0, 1])
async def test_every_answer_reaches_the_client_the_same_on_both_clients(
    nc: Client, js: JetStreamContext, continuation_limit: int, chunk_relay: str
) -> None:
    async with two(nc, js, continuation_limit, chunk_relay) as (plane, lean, rep):
        ref_used, lean_used = _recorded(plane.gateway), _recorded(lean)
        for model in [*SCRIPTS, "refused"]:
            for stream in (False, True):
                for options in ({}, {"stream_options": {"include_usage": True}}):
                    if options and not stream:
                        continue
                    body = {
                        "model": f"{model}-{plane.node}",
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 3,
                        "stream": stream,
                        **options,
                    }
                    n = len(rep.asked)
                    a = await _ask(plane.http, plane.gateway.url, body)
                    asked_a = rep.asked[n:]
                    n = len(rep.asked)
                    b = await _ask(plane.http, lean.url, body)
                    asked_b = rep.asked[n:]
                    case = f"{model} stream={stream} {options}"
                    assert a == b, case
                    assert asked_a == asked_b, case
                    assert ref_used == lean_used, case
        assert len(ref_used) > 10  # the answers were counted


async def test_the_openai_client_gets_the_same_from_both(nc: Client, js: JetStreamContext) -> None:
    async with two(nc, js, 1) as (plane, lean, _):
        model = f"whole-{plane.node}"
        smodel = f"stream-{plane.node}"
        got = []
        for gw in (plane.gateway, lean):
            client = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
            whole = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            events = await client.chat.completions.create(
                model=smodel,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                stream=True,
            )
            text = "".join([c.choices[0].delta.content or "" async for c in events if c.choices])
            got.append((whole.choices[0].message.content, whole.usage, text))
            await client.close()
        assert got[0] == got[1] and got[0][2] == "a b c"


async def test_the_lean_client_keeps_its_connections_alive(
    nc: Client, js: JetStreamContext
) -> None:
    async with two(nc, js, 1) as (plane, lean, rep):
        body = {"model": f"whole-{plane.node}", "messages": [{"role": "user", "content": "hi"}]}
        before = rep.connections
        for _ in range(20):
            status, *_ = await _ask(plane.http, lean.url, body)
            assert status == 200
        assert rep.connections - before == 1
        # An answer that closes its connection (the first on the kept one) is not kept:
        # each next one opens another.
        body["model"] = f"close-{plane.node}"
        for _ in range(3):
            status, *_ = await _ask(plane.http, lean.url, body)
            assert status == 200
        assert rep.connections - before == 3


# ------------------------------------------------------------------------ the body's sink


class _Pieces:
    """A replica that answers a stream's head, then each piece it is handed, then ends
    it (or breaks its connection)."""

    def __init__(self) -> None:
        self.writer: asyncio.StreamWriter | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.writer = writer
        writer.write(SSE)

    async def send(self, piece: bytes) -> None:
        assert self.writer is not None
        self.writer.writelines(_chunked(piece))
        await self.writer.drain()


async def _got(taken: list[bytes]) -> list[bytes]:
    return list(taken)


@contextlib.asynccontextmanager
async def _pieces(readers: str) -> AsyncIterator[tuple[_Pieces, Any]]:
    """A stream's answer begun on a lean client whose read callbacks are `readers`' (a
    `--chunk-relay`: `compiled`, or `python`, `_Conn`'s own)."""
    rep = _Pieces()
    server = await asyncio.start_server(rep.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    session = LeanSession(2, 5, relay.pick(readers).readers)
    try:
        url = yarl.URL(f"http://127.0.0.1:{port}/v1/x")
        answer = await session.post(url, data=b"{}", headers={})
        yield rep, answer
    finally:
        await session.close()
        if rep.writer is not None:
            rep.writer.close()
        server.close()


@pytest.mark.parametrize("readers", ["compiled", "python"])
async def test_a_sink_takes_each_read_until_it_stops_then_reads_are_kept(readers: str) -> None:
    """`Body.sink`: each read passed to it where it was read, its reader not woken; once
    it says stop, its waiter is set and what comes next waits for `readany`; the answer's
    end comes to `readany` as b""."""
    async with _pieces(readers) as (rep, answer):
        taken: list[bytes] = []
        body = answer.content
        assert body._take() is None

        def take(data: bytes) -> bool:
            taken.append(data)
            return data != b"stop"

        waiter = body.sink(take)
        await rep.send(b"one")
        await wait_for(lambda: _got(taken), lambda t: t == [b"one"])
        assert not waiter.done()  # taken in the read's callback: nobody woken
        await rep.send(b"stop")
        await asyncio.wait_for(waiter, 5)
        body.unsink()
        await rep.send(b"kept")
        assert await body.readany() == b"kept"
        assert taken == [b"one", b"stop"]
        assert rep.writer is not None
        rep.writer.write(b"0\r\n\r\n")
        assert await body.readany() == b""


@pytest.mark.parametrize("readers", ["compiled", "python"])
async def test_a_sinks_answer_broken_wakes_its_waiter_and_raises_at_the_next_read(
    readers: str,
) -> None:
    async with _pieces(readers) as (rep, answer):
        taken: list[bytes] = []

        def take(data: bytes) -> bool:
            taken.append(data)
            return True

        waiter = answer.content.sink(take)
        await rep.send(b"one")
        assert rep.writer is not None
        rep.writer.close()  # the replica gone mid-answer
        await asyncio.wait_for(waiter, 5)
        answer.content.unsink()
        with pytest.raises(aiohttp.ClientPayloadError):
            await answer.content.readany()
        assert taken == [b"one"]
