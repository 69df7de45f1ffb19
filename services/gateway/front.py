"""The lean server: the gateway's HTTP/1.1 server on a plain `asyncio.Protocol`,
requests read with httptools (llhttp, the parser aiohttp's own server wraps).

Used by `services.gateway.server.Gateway.run` when `--server lean` (the default);
`--server aiohttp` keeps aiohttp's server, the reference this one is proven equal to
(tests/gateway/test_front.py: the same requests, good and hostile, through a gateway on
each, get the same status and body, and leave it serving). It is the part of aiohttp's
server the gateway uses and no more: a request's handler is started once its head is
read (the body is read as it comes, `Request.content`), one request at a time per
connection (pipelined ones wait their turn, read no further meanwhile); an answer is
sent whole (`exchange.Whole`, with its Content-Length) or as a stream
(`Request.begin`, chunked). What aiohttp's server did per request besides (its
request, response, writer and payload objects, its router, middleware chain and access
log machinery, a timer re-armed per request) is not done.

What it keeps of HTTP: keep-alive (HTTP/1.1's default, HTTP/1.0's when asked),
`Connection: close`, bodies by Content-Length or chunked, `Expect: 100-continue`,
HEAD for what GET serves. A request HTTP itself cannot parse (a bad request line, a
bad header, a bad chunk), or with a request line or a header over `MAX_FIELD` bytes,
over `MAX_HEADERS` headers or a head over `MAX_HEAD` bytes, is 400 and its connection
closed, said in one line per kind (`guard.Lines`); an error in a handler is 500 and its
connection closed. What it bounds: a body read and not yet taken by its handler past
`HIGH_WATER` stops the connection's reading (until it is taken); a pipelined request
waiting stops it too; an answer's write waits while the client does not read
(`pause_writing`); a connection with no request for `idle_timeout_s` is closed (a
slowloris's too); an answer given before its body was read whole reads the rest for at
most `LINGER_S` (aiohttp's lingering), then closes. A client gone cancels its request's
handler, as aiohttp's `handler_cancellation` does. Not served: upgrades (WebSocket,
h2c: the request is answered, the connection then closed), TLS, HTTP/2.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote

import httptools
from multidict import CIMultiDict

from services.gateway import guard
from services.gateway.exchange import Answer, Whole

# MAX_FIELD bounds a request line, a header's name and a header's value; MAX_HEADERS the
# headers of a request (aiohttp's server's limits: 8190 and 128). MAX_HEAD bounds a
# request's head, all of it (memory: a header is held whole until it ends).
MAX_FIELD = 8190
MAX_HEADERS = 128
MAX_HEAD = 1 << 20
# HIGH_WATER: the bytes of a body read and not yet taken by its handler past which the
# connection stops reading; it reads again once they are taken.
HIGH_WATER = 1 << 18
# LINGER_S: how long the rest of a body is read (and dropped) after its answer, before
# the connection is closed (aiohttp's `lingering_time`).
LINGER_S = 10.0

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_INTERNAL = b"500 Internal Server Error\n\nServer got itself in trouble"
_TEXT = {"Content-Type": "text/plain; charset=utf-8"}

Handler = Callable[["Request"], Awaitable[Answer]]

log = logging.getLogger("llmgw.gateway")


def answer_head(
    version: str,
    keep_alive: bool,
    status: int,
    headers: Mapping[str, str],
    length: int | None,
    date_line: bytes,
) -> bytes:
    """An answer's status line and headers: with its Content-Length (`length`), chunked
    (None), or to the connection's end (-1); `Connection` said where it is not the
    version's default (aiohttp's rule); `date_line` (the Date line and the head's end)
    last. `_relay.Head` is this rule compiled (`Front.head`)."""
    said = ""
    for k, v in headers.items():  # a loop, not a comprehension: no call of its own
        said += f"{k}: {v}\r\n"
    # No header may break a line (aiohttp's server refuses it too).
    if said.count("\n") != len(headers) or said.count("\r") != len(headers):
        raise ValueError("a header with a newline")
    head = b"HTTP/%b %d %b\r\n%b" % (
        b"1.1" if version == "1.1" else b"1.0",
        status,
        _REASONS.get(status, b""),
        said.encode("utf-8"),
    )
    if length is None:
        head += b"Transfer-Encoding: chunked\r\n"
    elif length >= 0:
        head += b"Content-Length: %d\r\n" % length
    if version == "1.1":
        if not keep_alive:
            head += b"Connection: close\r\n"
    elif keep_alive:
        head += b"Connection: keep-alive\r\n"
    return head + date_line


class BadBody(Exception):
    """A request's body HTTP cannot parse (a bad chunk): raised by its `readany`; the
    request is answered 400 and its connection closed."""


class Request(dict[Any, Any]):
    """One request as the handlers read it (`exchange.Request`), its body as it comes
    (`content` is the request itself: `is_eof`, `read_nowait`, `readany`), and its
    answer begun (`begin`).

    What is kept on it while it is served (the request's `web.RequestKey`s, a dozen
    reads and writes a request) is the request itself, a dict: its `[]` and `get` are
    the dict's own, in C, not methods of this class. A request is still equal only to
    itself, hashed by identity and true, as any object (`_Conn.waiting` finds it so)."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_eof",
        "_error",
        "_size",
        "_waiter",
        "content_length",
        "headers",
        "keep_alive",
        "method",
        "path",
        "sent",
        "started",
        "version",
    )

    def __init__(self, conn: _Conn, method: str, path: str, headers: CIMultiDict[str]) -> None:
        self._conn = conn
        self.method = method
        self.path = path
        self.headers = headers
        said = headers.get("Content-Length")
        self.content_length: int | None = int(said) if said is not None else None
        self.version = "1.1"
        self.keep_alive = True
        self.started = False
        """Its answer's head is sent."""
        self.sent: Whole | None = None
        """Its whole answer, sent before its handler ended (`send_now`)."""
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    # ---- a request is itself, not what is kept on it

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__  # type: ignore[assignment]

    def __bool__(self) -> bool:
        return True

    # ---- its connection, its body

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._conn.transport

    @property
    def content(self) -> Request:
        return self

    def is_eof(self) -> bool:
        """Whether the body has ended (read to its end or not), as aiohttp's
        `StreamReader.is_eof` says: a body that came whole with its head is then taken
        with `read_nowait`, no wait for it armed (`request.read_body`)."""
        return self._eof

    def read_nowait(self, n: int = -1) -> bytes:
        """What has come of the body and is not taken yet; what broke it raises."""
        if self._error is not None:
            raise self._error
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._taken(len(data))
        return data

    async def readany(self) -> bytes:
        """What has come of the body (b"" at its end); what broke it raises."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft()
        self._taken(len(data))
        return data

    def _taken(self, n: int) -> None:
        self._size -= n
        # A connection not paused has nothing to resume: whatever made it full (a body
        # past HIGH_WATER, a pipelined request) paused it as it did (`flow`).
        if self._size < HIGH_WATER and self._conn.paused:
            self._conn.flow()

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._waiter is not None:  # none, as a body that came with its head is fed
            self._wake()
        if self._size >= HIGH_WATER:
            self._conn.flow()

    def _end(self, error: BaseException | None = None) -> None:
        self._eof = True
        if error is not None and self._error is None:
            self._error = error
        if self._waiter is not None:
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ---- its answer

    def send_now(self, answer: Whole) -> Whole:
        """`answer` sent whole now (`exchange.send_now`), and kept as `sent`: returned by
        the handler, `_Conn._handle` sends no more of it (and waits, as for any answer,
        while the client does not read)."""
        body = answer.body
        self._conn.send_head(self, answer.status, answer.headers, len(body), body)
        self.sent = answer
        return answer

    async def begin(self, status: int, headers: Mapping[str, str]) -> Stream:
        """Its answer begun as a stream: chunked (HTTP/1.1), or to the connection's end
        (HTTP/1.0)."""
        chunked = self.version == "1.1"
        if not chunked:
            self.keep_alive = False
        self._conn.send_head(self, status, headers, None if chunked else -1)
        return Stream(self._conn, self, status, chunked)


class Stream:
    """An answer sent as it comes (`exchange.Stream`)."""

    __slots__ = ("_chunked", "_conn", "_request", "ended", "status")

    def __init__(self, conn: _Conn, request: Request, status: int, chunked: bool) -> None:
        self._conn = conn
        self._request = request
        self._chunked = chunked
        self.status = status
        self.ended = False

    async def write(self, data: bytes) -> None:
        # Written here, not in a coroutine of the connection's for each chunk; waited
        # on only when the client does not read.
        if self.put(data):
            await self._conn.drain()

    def put(self, data: bytes) -> bool:
        """`write` without its wait: `data` handed to the transport; whether the client
        is behind (`drain` then waits for it)."""
        if not data or self._request.method == "HEAD":
            return False
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        return self._conn.put(data)

    def relayed(self) -> tuple[_Conn, bool] | None:
        """The connection a relay writes this answer's chunks to and whether they are
        framed as HTTP chunks (`relay.Relay`); None for a HEAD's answer (no body)."""
        return None if self._request.method == "HEAD" else (self._conn, self._chunked)

    async def drain(self) -> None:
        """Until the client has read what waits to be sent, if it is behind."""
        if self._conn.write_paused:
            await self._conn.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        if self.ended:
            return
        if not self._chunked or self._request.method == "HEAD":
            if data:
                await self.write(data)
            self.ended = True
            return
        self.ended = True
        # The last chunk and the end of the chunks in one write.
        end = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n"
        await self._conn.write(end)


class _Conn(asyncio.Protocol):
    """One client connection: its parser, the request it serves and those waiting."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.loop = front.loop
        self.transport: asyncio.Transport | None = None
        self._pairs: list[tuple[str, str]] = []
        """The head being read's headers, as they come (`on_header`)."""
        if (built := front.compiled) is not None:
            # The header callback compiled (`--chunk-relay`): no Python frame for each
            # header of each request (`on_header`'s body, step for step).
            self.on_header = built.OnHeader(self, self._pairs, MAX_HEADERS)  # type: ignore[method-assign]
        self.parser = httptools.HttpRequestParser(self)
        self.reading: Request | None = None
        """The request whose head or body is being read."""
        self.serving: Request | None = None
        self.task: asyncio.Task[None] | None = None
        """The connection's one task, serving its requests one after another (`_run`):
        made for its first request, kept while it is open."""
        self.parked: asyncio.Future[Request] | None = None
        """What `task` waits on between two requests: the next one (`_serve`)."""
        self.waiting: deque[Request] = deque()
        """Pipelined requests, their heads read, waiting their turn."""
        self.refused: tuple[int, str] | None = None
        """What HTTP could not parse, answered after the request being served."""
        self.closing = False
        self.paused = False
        self.write_paused = False
        self.drained: asyncio.Future[None] | None = None
        self.last = self.loop.time()
        self.timer: asyncio.TimerHandle | None = None
        self.lingering: asyncio.TimerHandle | None = None
        self._url = b""
        self._head = 0
        """The bytes of the reads before this one of a head not whole yet."""
        self._fed = 0
        """The bytes of the read being parsed."""
        self._in_head = False
        self._bad: str | None = None

    # ---- the connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport's subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)
        self.front.conns.add(self)
        self.timer = self.loop.call_at(self.last + self.front.idle_timeout_s, self._idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.front.conns.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        if self.lingering is not None:
            self.lingering.cancel()
        gone = ConnectionResetError("the client closed the connection")
        for r in (self.reading, self.serving, *self.waiting):
            if r is not None:
                r._end(gone)
        if self.drained is not None and not self.drained.done():
            self.drained.set_exception(gone)
            self.drained.exception()  # retrieved: nobody may be waiting
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.transport = None

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    def _idle(self) -> None:
        """Close a connection with no request for `idle_timeout_s`; look again later
        while it has one."""
        self.timer = None
        if self.closing:
            return
        now = self.loop.time()
        if self.serving is None:
            at = self.last + self.front.idle_timeout_s
            if now >= at:
                self.close()
                return
        else:
            at = now + self.front.idle_timeout_s
        self.timer = self.loop.call_at(at, self._idle)

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            if self.transport is not None:
                self.transport.close()

    def flow(self) -> None:
        """Read while nothing waits to be taken: no body past HIGH_WATER unread, no
        pipelined request waiting."""
        if self.transport is None or self.closing:
            return
        full = bool(self.waiting) or (self.reading is not None and self.reading._size >= HIGH_WATER)
        if full and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        elif not full and self.paused:
            self.paused = False
            self.transport.resume_reading()

    # ---- reading

    def data_received(self, data: bytes) -> None:
        if self.closing or self.refused is not None:
            return
        self._fed = len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # The request is answered; what follows it is not HTTP/1.1 (an upgrade is not
            # served): the connection closes after the answer.
            self.refused = (0, "")
            self._after_refusal()
            return
        except httptools.HttpParserError as e:
            self._refuse(self._bad or str(e) or type(e).__name__)
            return
        if self._in_head:
            # A head not yet whole (httptools holds a header until its end): bounded.
            self._head += len(data)
            if self._head > MAX_HEAD:
                self._refuse(f"a request head over {MAX_HEAD} bytes")

    def on_message_begin(self) -> None:
        self._url = b""
        self._head = 0
        self._in_head = True
        self._pairs.clear()
        self._bad = None

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_FIELD:
            self._bad = f"a request line over {MAX_FIELD} bytes"
            raise ValueError(self._bad)

    def on_header(self, name: bytes, value: bytes) -> None:
        # Counted as each comes (what one head may hold is bounded); their lengths once
        # the head is whole, and only if it may hold one past MAX_FIELD (`_fields`): a
        # head is at most MAX_HEAD bytes, held meanwhile.
        pairs = self._pairs
        if len(pairs) >= MAX_HEADERS:
            self._bad = f"over {MAX_HEADERS} headers"
            raise ValueError(self._bad)
        pairs.append((name.decode("latin-1"), value.decode("latin-1")))

    def _fields(self) -> None:
        """A header's name or value over MAX_FIELD bytes: 400 (latin-1: a character a
        byte)."""
        for k, v in self._pairs:
            if len(k) > MAX_FIELD or len(v) > MAX_FIELD:
                self._bad = f"a header over {MAX_FIELD} bytes"
                raise ValueError(self._bad)

    def on_headers_complete(self) -> None:
        self._in_head = False
        # The head came in this read and those before it: none of its fields is longer.
        if self._head + self._fed > MAX_FIELD:
            self._fields()
        parser = self.parser
        url = self._url
        path = (
            url.partition(b"?")[0] if url[:1] == b"/" else (httptools.parse_url(url).path or b"/")
        )
        text = path.decode("utf-8", "surrogateescape")
        if "%" in text:
            text = unquote(text, errors="surrogateescape")
        # Built whole, in one call, of the pairs as they came: a name said twice is
        # kept twice, in order, as `add` for each would keep it.
        headers: CIMultiDict[str] = CIMultiDict(self._pairs)
        self._pairs.clear()
        try:
            request = Request(self, parser.get_method().decode("ascii"), text, headers)
        except ValueError:
            self._bad = "a Content-Length that is not a number"
            raise
        request.version = parser.get_http_version()
        request.keep_alive = parser.should_keep_alive()
        self.reading = request
        if self.serving is None:
            self._serve(request)
        else:
            self.waiting.append(request)
            self.flow()

    def on_body(self, body: bytes) -> None:
        r = self.reading
        if r is not None and not r._eof:
            r._feed(body)

    def on_message_complete(self) -> None:
        r = self.reading
        self.reading = None
        if r is None:
            return
        r._end()
        if self.lingering is not None and r is self.serving:
            # The rest of an answered request's body is read: the connection goes on.
            self.lingering.cancel()
            self.lingering = None
            self._after(r)

    # ---- serving

    def _serve(self, request: Request) -> None:
        self.serving = request
        if request.version == "1.1" and request.headers.get("Expect", "").lower() == "100-continue":
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        parked = self.parked
        if parked is not None:
            self.parked = None
            parked.set_result(request)
        elif self.task is None or self.task.done():
            self.task = self.loop.create_task(self._run(request))
        # Else called by the task itself as a request ends (`_next`): it takes this one
        # up as it returns from the last (`_run`).

    async def _run(self, request: Request) -> None:
        """The connection's requests, one after another, in one task: not a task made
        (and registered, and dropped) for each. Each is answered as `_handle` says; the
        task waits for the next between them, and ends with the connection (a client
        gone cancels it, and its request's handler with it) or the server's stop."""
        while await self._handle(request):
            nxt = self.serving
            if nxt is not None and nxt is not request:
                request = nxt  # a pipelined one, taken up as the last ended (`_next`)
                continue
            if self.closing or self.front.stopping:
                return
            # None served, or the last one's body still read (`_done`'s lingering). The
            # last one is not held while the connection waits (what was kept on it).
            del request, nxt
            self.parked = self.loop.create_future()
            request = await self.parked

    async def _handle(self, request: Request) -> bool:
        """`request` answered; whether the connection's task goes on (it does not once
        it is cancelled)."""
        front = self.front
        try:
            answer = await front.handler(request)
        except asyncio.CancelledError:
            return False
        except BadBody:
            # Its body could not be parsed: 400 (`_refuse`), the connection closed.
            self.serving = None
            self._after_refusal()
            return False
        except ConnectionError:
            # Written to a connection the client has closed: nothing more to send.
            self.close()
            return False
        except Exception as e:
            _say(front, "error", request, "", e)
            log.debug("gateway: %s %s", request.method, request.path, exc_info=e)
            if request.started:
                self.close()
                return False
            request.keep_alive = False
            answer = Whole(_INTERNAL, 500, _TEXT)
        try:
            if isinstance(answer, Whole):
                if answer is not request.sent:  # else sent before its handler ended
                    body = answer.body
                    self.send_head(request, answer.status, answer.headers, len(body), body)
                if self.write_paused:
                    await self.write(b"")
            elif isinstance(answer, Stream):
                await answer.write_eof()
        except ConnectionError:
            self.close()
            return False
        except Exception as e:
            _say(front, "answer", request, "its answer cannot be sent: ", e)
            self.close()
            return False
        self._done(request)
        return True

    def _done(self, request: Request) -> None:
        """`request` answered: the next one, or the rest of its body read first, or the
        connection closed."""
        self.last = self.loop.time()
        if request is self.reading and not self.closing:
            # Answered before its body was read whole: read the rest (dropped) for at
            # most LINGER_S, then go on (or close). Closed at once, the client could lose
            # the answer: a close with its bytes unread is a reset, which drops what the
            # client had not read yet.
            request._chunks.clear()
            request._size = 0
            request._eof = True
            self.flow()
            self.lingering = self.loop.call_later(LINGER_S, self.close)
            return
        self._after(request)

    def _after(self, request: Request) -> None:
        if not request.keep_alive or self.closing:
            self.serving = None
            self.close()
            return
        self._next()

    def _next(self) -> None:
        self.serving = None
        if self.closing:
            return
        if self.waiting:
            request = self.waiting.popleft()
            self.flow()
            self._serve(request)
            return
        if self.refused is not None:
            self._after_refusal()

    def _refuse(self, why: str) -> None:
        """What HTTP could not parse: 400 and the connection closed, once the request
        being served (if any) is answered."""
        self.refused = (400, why)
        r = self.reading
        if r is not None and r is not self.serving and r in self.waiting:
            self.waiting.remove(r)
        if r is not None:
            r._end(BadBody(why))
        self.reading = None
        if self.serving is None:
            self._after_refusal()

    def _after_refusal(self) -> None:
        assert self.refused is not None
        status, why = self.refused
        if self.serving is not None or self.waiting:
            return
        if status and self.transport is not None and not self.closing:
            self.front.lines.say(
                logging.WARNING,
                ("refused", why.partition(":")[0][:40]),
                "gateway: %d from %s: HTTP it cannot parse: %s",
                status,
                _peer(self.transport),
                guard.shown(why),
            )
            body = f"{status}, message:\n  {why}".encode()
            head = b"HTTP/1.1 %d %b\r\nContent-Type: text/plain; charset=utf-8\r\n" % (
                status,
                _REASONS.get(status, b""),
            )
            self.transport.write(
                head
                + b"Content-Length: %d\r\nConnection: close\r\nDate: %b\r\n\r\n"
                % (len(body), self.front.date())
                + body
            )
        self.close()

    # ---- writing

    def send_head(
        self,
        request: Request,
        status: int,
        headers: Mapping[str, str],
        length: int | None,
        body: bytes = b"",
    ) -> None:
        """The answer's status line and headers: with its Content-Length (`length`),
        chunked (None), or to the connection's end (-1); `body` (a whole answer's) in
        the same write."""
        if request.started or self.transport is None or self.closing:
            raise ConnectionResetError("the connection is closed")
        request.started = True
        front = self.front
        head = front.head(
            request.version, request.keep_alive, status, headers, length, front.date_line
        )
        if not body or request.method == "HEAD":
            self.transport.write(head)
        elif len(body) < 65536:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))

    async def write(self, data: bytes) -> None:
        if self.put(data):
            await self.drain()

    def put(self, data: bytes) -> bool:
        """`data` handed to the transport; whether the client is behind (`drain` then
        waits for it)."""
        if self.transport is None or self.closing:
            raise ConnectionResetError("Cannot write to closing transport")
        self.transport.write(data)
        return self.write_paused

    async def drain(self) -> None:
        """Until the client has read what waits to be sent (`resume_writing`)."""
        if self.drained is None:
            self.drained = self.loop.create_future()
        await self.drained


def _say(front: Front, kind: str, request: Request, what: str, e: Exception) -> None:
    """One line (`guard.Lines`: once per kind, then at most every so often) for an
    error in a handler or in sending its answer."""
    front.lines.say(
        logging.ERROR,
        (kind, type(e).__name__),
        "gateway: %s %s: %s%s: %s",
        request.method,
        guard.shown(request.path),
        what,
        type(e).__name__,
        guard.shown(e),
    )


def _peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return "a client"


class Front:
    """The lean server on one listening socket: `handler` answers each request."""

    def __init__(
        self,
        handler: Handler,
        lines: guard.Lines,
        idle_timeout_s: float,
        shutdown_timeout_s: float = 2.0,
        compiled: Any = None,
    ) -> None:
        self.handler = handler
        self.compiled = compiled
        """The compiled relay's module (`relay.Picked.readers`): each connection's header
        callback (`OnHeader`) and the answers' heads (`Head`) from it; None: the rules
        here."""
        self.head: Callable[..., bytes] = (
            answer_head if compiled is None else compiled.Head(_REASONS, answer_head)
        )
        """`answer_head`, or the same compiled."""
        self.lines = lines
        self.idle_timeout_s = idle_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.loop = asyncio.get_running_loop()
        self.conns: set[_Conn] = set()
        self.server: asyncio.Server | None = None
        self.stopping = False
        """`stop` has begun: a connection's task ends with the request it serves."""
        self._date = (0, b"")
        self.date_line = b"Date: %b\r\n\r\n" % self.date()
        """The Date header's line and the head's end, as each answer's head ends: made
        again as each second begins while the server runs (`_tick`), not asked of the
        clock for each answer."""
        self._ticker: asyncio.TimerHandle | None = None

    def date(self) -> bytes:
        """The Date header's value, made once a second."""
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, formatdate(now, usegmt=True).encode())
        return self._date[1]

    def _tick(self) -> None:
        self.date_line = b"Date: %b\r\n\r\n" % self.date()
        wall = time.time()
        self._ticker = self.loop.call_later(math.ceil(wall) - wall + 0.001, self._tick)

    async def start(self, sock: Any) -> None:
        self.loop = asyncio.get_running_loop()
        self._tick()
        self.server = await self.loop.create_server(lambda: _Conn(self), sock=sock)

    async def stop(self) -> None:
        """Stop listening, close the idle connections, give the requests in flight
        `shutdown_timeout_s` to end, then cut them."""
        self.stopping = True
        if self.server is not None:
            self.server.close()
        for c in list(self.conns):
            if c.serving is None:
                c.close()
        # A connection's task waiting for its next request is not busy: it ends as its
        # connection closes.
        busy = [
            c.task
            for c in self.conns
            if c.serving is not None
            and c.parked is None
            and c.task is not None
            and not c.task.done()
        ]
        if busy:
            await asyncio.wait(busy, timeout=self.shutdown_timeout_s)
        for c in list(self.conns):
            if c.task is not None and not c.task.done():
                c.task.cancel()
            c.close()
        busy = [c.task for c in list(self.conns) if c.task is not None and not c.task.done()]
        if busy:
            with contextlib.suppress(Exception):
                await asyncio.wait(busy, timeout=1.0)
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 1.0)
        if self._ticker is not None:
            self._ticker.cancel()
