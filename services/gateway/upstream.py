"""The lean upstream client: keep-alive connections to the replicas on a plain
`asyncio.Protocol`, answers read with httptools (llhttp, the parser aiohttp's own client
wraps).

Used by `services.gateway.forward.Forwarder` when `--upstream-client lean` (the
default); `--upstream-client aiohttp` keeps aiohttp's `ClientSession`, the reference this
one is proven equal to (tests/gateway/test_upstream_client.py: the same bytes to the
client, the same use counted, the same errors). It is the part of aiohttp's client the
gateway uses and no more: `post(url, data, headers)` sends the request head and body in
one write on an idle connection of the replica's pool (a new one past them, within
`connect_timeout_s`), and returns once the answer's status and headers are read; the
body is read as it comes (`content.readany`, `content.iter_any`), at most
`upstream_timeout_s` between two reads; a whole answer puts its connection back in the
pool, a closed or half-read one closes it. What aiohttp's client did per request besides
(its request and response objects, its connector's bookkeeping, a timer re-armed at each
read, cookie and redirect handling) is not done: measured, it cost about a third of the
gateway's CPU per request (docs/performance.md). Failures are aiohttp's exception
classes where the forwarder already reads them (`ServerDisconnectedError`,
`ConnectionTimeoutError`, `SocketTimeoutError`, `ClientPayloadError`), or `ConnectFailed`
and `NotHttp`, which it reads as it reads aiohttp's `ClientConnectorError` and
`ClientResponseError`. Unlike aiohttp's, a redirect is not followed: a replica's 3xx goes
to the client as it came.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, cast

import aiohttp
import httptools
import yarl
from multidict import CIMultiDict, CIMultiDictProxy

# IDLE_S is how long an idle connection is kept in its pool (aiohttp's connector's
# keep-alive default); HIGH_WATER the bytes of an answer read and not yet passed on
# past which its connection stops reading (the client is slow), LOW_WATER where it
# reads again.
IDLE_S = 15.0
# MAX_KEPT bounds the URLs whose pool and request line are kept (`LeanSession._begun`).
MAX_KEPT = 4096
HIGH_WATER = 1 << 17
LOW_WATER = 1 << 15
# _UNPARSED are what the parser raises for an answer it cannot read (`_Conn._unparsed`).
_UNPARSED = (httptools.HttpParserError, httptools.HttpParserUpgrade)


class ConnectFailed(aiohttp.ClientConnectionError):
    """The replica could not be connected to (`os_error` says why)."""

    def __init__(self, os_error: OSError) -> None:
        super().__init__(str(os_error))
        self.os_error = os_error


class NotHttp(aiohttp.ClientError):
    """What the replica answered is not an HTTP answer (`message`, the parser's)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Body:
    """An answer's body as it comes: `readany` (what has come, b"" at its end),
    `iter_any`; a break raises at the next read, as aiohttp's `StreamReader` does. Or,
    while a reader waits with `sink`, each read passed to it in the read's callback."""

    def __init__(self, conn: _Conn) -> None:
        self._conn: _Conn | None = conn
        self._loop = conn.pool.loop
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], bool] | None = None

    def _feed(self, data: bytes) -> None:
        """`data` kept for its reader, woken (what a sink takes is not: `on_body`)."""
        self._chunks.append(data)
        self._size += len(data)
        if self._waiter is not None:  # none yet, as a whole answer's body comes
            self._wake()
        if self._size > HIGH_WATER and self._conn is not None:
            self._conn.pause()

    def _end(self, exc: BaseException | None = None) -> None:
        if exc is None:
            self._eof = True
        elif not self._eof:
            self._exc = exc
        self._conn = None
        self._sink = None
        if self._waiter is not None:
            self._wake()

    def _wake(self) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def _take(self) -> bytes | None:
        """What has come (b"" at the end), or None while nothing has; what broke it
        raises."""
        if self._exc is not None:
            raise self._exc
        if self._chunks:
            data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
            self._chunks.clear()
            self._size = 0
            conn = self._conn
            if conn is not None and conn.paused:
                conn.resume()
            return data
        return b"" if self._eof else None

    def taken_whole(self) -> bytes | None:
        """The whole body, taken, when all of it has come (its end read, nothing broke:
        an answer read whole with its head, as most are); None otherwise, nothing
        taken (read it with `readany`)."""
        if not self._eof or self._exc is not None:
            return None
        data = self._take()
        assert data is not None  # ended: b"" at the least
        return data

    def _wait(self) -> asyncio.Future[None]:
        """A future that `_feed` or `_end` sets (awaited as it is: no coroutine of its own
        for each chunk); the last one taken, or cancelled, is never set again."""
        # The connection's loop, kept: `asyncio.get_running_loop()` asks the kernel for
        # the process's id each time (CPython 3.11), once a chunk.
        self._waiter = w = self._loop.create_future()
        return w

    def sink(self, take: Callable[[bytes], bool]) -> asyncio.Future[None]:
        """Pass each read to `take` as it comes, in the read's callback (`take` returns
        whether to go on; it must not raise), until it says to stop or the body ends or
        breaks; the future to wait on meanwhile, set then. Only once `_take` has found
        nothing: what comes after the sink stops is read as before. Cancelled, the
        waiter's `unsink` ends it."""
        assert not self._chunks and not self._eof and self._exc is None
        self._sink = take
        return self._wait()

    def unsink(self) -> None:
        self._sink = None

    async def readany(self) -> bytes:
        while (data := self._take()) is None:
            await self._wait()
        return data

    def iter_any(self) -> Body:
        return self

    def __aiter__(self) -> Body:
        return self

    async def __anext__(self) -> bytes:
        # `readany`'s loop, not a call of it: one coroutine less for each chunk of a
        # stream passed on.
        while (data := self._take()) is None:
            await self._wait()
        if not data:
            raise StopAsyncIteration
        return data


class Answer:
    """A replica's answer begun: `status`, `headers`, `content_length`, `content` (its
    `Body`); `close()` drops its connection, `release()` returns it to its pool when the
    answer was read whole (else drops it too)."""

    def __init__(self, conn: _Conn, status: int, headers: CIMultiDict[str]) -> None:
        self._conn = conn
        self.status = status
        self.headers = CIMultiDictProxy(headers)
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self.content = conn.body

    def close(self) -> None:
        """Drop its connection, unless the answer was read whole (the connection is then
        back in its pool, or serving another request: not this answer's to close)."""
        if self._conn.body is self.content and not self._conn.done:
            self._conn.close()

    def release(self) -> None:
        self.close()


class _Conn(asyncio.Protocol):
    """One keep-alive connection to a replica, answering one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self._said: dict[Any, Any] = {}
        built = pool.readers
        # httptools' header callback is the dict's own `setdefault`, in C: no Python
        # frame for each header of each answer. A name said twice keeps its first value,
        # the one `CIMultiDict.get` gives (what the gateway reads of an answer's head).
        # Compiled (`--chunk-relay`), the same with the name and the value decoded as they
        # come (`_relay.OnAnswerHeader`), not by `on_headers_complete`.
        self._decoded = built is not None
        self.on_header = (
            self._said.setdefault if built is None else built.OnAnswerHeader(self._said)
        )
        if built is not None:
            # The read callbacks compiled (`--chunk-relay`): what httptools and the loop
            # call for each read, with no Python frame (this class's, step for step).
            self.on_body = built.OnBody(self)  # type: ignore[method-assign]
        self.parser = httptools.HttpResponseParser(self)
        if built is not None:
            self.data_received = built.OnData(  # type: ignore[method-assign]
                self, pool.loop.time, self.parser.feed_data, _UNPARSED, self._unparsed
            )
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.status_seen = False
        self.head: asyncio.Future[Answer] | None = None
        self.body = Body(self)
        self.done = True
        """The last answer was read to its end (the connection may take another)."""
        self.closed = False
        self.paused = False
        self.last_read = 0.0
        self.idle_since = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's transports are not subclasses of
        # asyncio's.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.last_read = self.pool.loop.time()
        try:
            self.parser.feed_data(data)
        except _UNPARSED as e:
            self._unparsed(e, data)

    def _unparsed(self, e: Exception, data: bytes) -> None:
        """What the parser could not read of `data` (`_UNPARSED`): the answer failed."""
        if isinstance(e, httptools.HttpParserUpgrade):
            self._fail(NotHttp("an upgrade to another protocol"), aiohttp.ClientPayloadError)
            return
        status_line = not self.status_seen or isinstance(e, httptools.HttpParserInvalidStatusError)
        self._fail(NotHttp(_parser_message(e, data, status_line)), aiohttp.ClientPayloadError)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        self.pool.forget(self)
        whole = not self.done and self.head is not None and self.head.done()
        if whole and self._until_eof():
            # An answer with no length nor chunks ends with its connection.
            self.done = True
            self.body._end()
            return
        self._fail(
            aiohttp.ServerDisconnectedError(),
            lambda: aiohttp.ClientPayloadError("Response payload is not completed"),
        )

    # -- httptools callbacks
    def on_status(self, status: bytes) -> None:
        self.status_seen = True

    def on_headers_complete(self) -> None:
        said = self._said
        self.headers = (
            CIMultiDict(said)
            if self._decoded
            else CIMultiDict([(k.decode("latin-1"), v.decode("latin-1")) for k, v in said.items()])
        )
        said.clear()
        status = self.parser.get_status_code()
        if status < 200:
            return  # an interim answer (100 Continue): the next answer's head follows
        answer = Answer(self, status, self.headers)
        if self.head is not None and not self.head.done():
            self.head.set_result(answer)

    def on_body(self, data: bytes) -> None:
        body = self.body
        sink = body._sink
        if sink is None:
            body._feed(data)
        elif not sink(data):
            # Taken where it was read, no reader woken for it: unless the sink stops.
            body._sink = None
            body._wake()

    def on_message_complete(self) -> None:
        if self.head is None or not self.head.done():
            return  # an interim answer's end
        self.done = True
        # The read timer is left to run out (`_check` finds the answer done): armed once
        # for the connection's run of answers, not once an answer.
        self.body._end()
        self.resume()  # the answer whole: its reader's pace no longer holds the connection
        if self.parser.should_keep_alive() and not self.closed:
            self.pool.give_back(self)
        else:
            self.close()

    # -- the request
    def send(self, head: bytes, data: bytes) -> asyncio.Future[Answer]:
        assert self.transport is not None
        self.headers = CIMultiDict()
        self._said.clear()
        self.status_seen = False
        self.body = Body(self)
        self.done = False
        self.head = self.pool.loop.create_future()
        self.last_read = self.pool.loop.time()
        if self._timer is None:
            self._arm(self.pool.read_timeout_s)
        self.transport.write(head + data if len(data) < 65536 else head)
        if len(data) >= 65536:
            self.transport.write(data)
        return self.head

    def close(self) -> None:
        self.closed = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()
        self.pool.forget(self)
        if not self.done:
            self._fail(
                aiohttp.ServerDisconnectedError(),
                lambda: aiohttp.ClientPayloadError("Response payload is not completed"),
            )

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.last_read = self.pool.loop.time()
            self.transport.resume_reading()

    # -- inside
    def _until_eof(self) -> bool:
        h = self.headers
        return "Content-Length" not in h and "chunked" not in h.get("Transfer-Encoding", "")

    def _fail(self, before: BaseException, after: Any) -> None:
        """The answer broken: `before` for one whose head has not come, `after()` for
        one whose body was being read."""
        if self.done:
            return
        self.done = True
        if self.head is not None and not self.head.done():
            self.head.set_exception(before)
        else:
            self.body._end(after() if callable(after) else after)
        if not self.closed and self.transport is not None:
            self.closed = True
            self._cancel_timer()
            self.transport.close()
            self.pool.forget(self)

    def _arm(self, after_s: float) -> None:
        self._cancel_timer()
        self._timer = self.pool.loop.call_later(after_s, self._check)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        """The read timer (one while answers come on the connection, re-armed only when
        it fires, then only while an answer is being read): nothing read for
        `read_timeout_s` while the answer is not whole and reading is not paused for a
        slow client is a timeout."""
        self._timer = None
        if self.done or self.closed:
            return
        now = self.pool.loop.time()
        due = self.last_read + self.pool.read_timeout_s
        if self.paused or now < due:
            self._arm(max(due - now, 0.001) if not self.paused else self.pool.read_timeout_s)
            return
        self._fail(
            aiohttp.SocketTimeoutError("Timeout on reading data from socket"),
            lambda: aiohttp.SocketTimeoutError("Timeout on reading data from socket"),
        )


def _parser_message(e: Exception, data: bytes, status_line: bool) -> str:
    """The parser's refusal as aiohttp's client says it (both wrap llhttp): its reason,
    the line it refused and a caret, after `Bad status line:` for one refused before its
    status. httptools does not say where in the line llhttp stopped: the caret is at the
    line's start, where it is for an answer that is not HTTP from its first byte."""
    line = data.split(b"\r\n", 1)[0]
    said = f"{e}:\n\n  {line!r}\n    ^"
    return f"Bad status line:\n  {said}" if status_line else said


class Pool:
    """One replica's (one scheme, host and port) idle keep-alive connections."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        url: yarl.URL,
        connect_timeout_s: float,
        read_timeout_s: float,
        readers: Any = None,
    ) -> None:
        self.loop = loop
        self.readers = readers
        """The compiled read callbacks' module (`services.gateway._relay`), or None."""
        self.host = url.raw_host or ""
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.tls: ssl.SSLContext | None = (
            ssl.create_default_context() if url.scheme == "https" else None
        )
        authority = f"[{self.host}]" if ":" in self.host else self.host
        if url.port is not None and not url.is_default_port():
            authority = f"{authority}:{url.port}"
        self.authority = authority.encode("idna" if not authority.isascii() else "ascii")
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle: list[_Conn] = []
        self.open: set[_Conn] = set()

    def kept(self) -> _Conn | None:
        """An idle connection that may take a request, or None."""
        now = self.loop.time()
        while self.idle:
            c = self.idle.pop()
            if c.closed or c.transport is None or c.transport.is_closing():
                continue
            if now - c.idle_since > IDLE_S:
                c.close()
                continue
            return c
        return None

    async def connection(self) -> _Conn:
        """`kept`, else a new connection."""
        c = self.kept()
        if c is not None:
            return c
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, c = await self.loop.create_connection(
                    lambda: _Conn(self),
                    self.host,
                    self.port,
                    ssl=self.tls,
                    server_hostname=self.host if self.tls is not None else None,
                )
        except TimeoutError:
            raise aiohttp.ConnectionTimeoutError(
                f"Connection timeout to host {self.host}:{self.port}"
            ) from None
        except OSError as e:
            raise ConnectFailed(e) from None
        self.open.add(c)
        return c

    def give_back(self, c: _Conn) -> None:
        c.idle_since = self.loop.time()
        self.idle.append(c)

    def forget(self, c: _Conn) -> None:
        self.open.discard(c)
        if c in self.idle:
            self.idle.remove(c)

    def close(self) -> None:
        for c in list(self.open):
            c.close()
        self.idle.clear()


def request_head(start: bytes, headers: Mapping[str, str], length: int) -> bytes:
    """A request's head: its request line and Host (`start`), `headers` (besides
    Content-Length and, unless given, `Accept: */*`, as aiohttp's client sends), and
    its Content-Length. `_relay.RequestHead` is this rule compiled."""
    lines = [start]
    for name, value in headers.items():
        lines += (b"\r\n", name.encode(), b": ", value.encode("utf-8", "surrogateescape"))
    if "Accept" not in headers:
        lines.append(b"\r\nAccept: */*")
    lines += (b"\r\nContent-Length: ", str(length).encode(), b"\r\n\r\n")
    return b"".join(lines)


class LeanSession:
    """The lean client: a `Pool` per replica, what aiohttp's `ClientSession` was to the
    forwarder (`post`, `close`)."""

    def __init__(
        self, connect_timeout_s: float, read_timeout_s: float, readers: Any = None
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.readers = readers
        """Each connection's read callbacks compiled: `services.gateway._relay` (chosen
        with the chunk relay, `--chunk-relay`); None: `_Conn`'s own."""
        self.head_of: Callable[[bytes, Mapping[str, str], int], bytes] = (
            request_head if readers is None else readers.RequestHead(request_head)
        )
        """`request_head`, or the same compiled."""
        self.pools: dict[tuple[str, str | None, int | None], Pool] = {}
        self._by_url: dict[int, tuple[yarl.URL, Pool, bytes]] = {}
        """Per URL asked (by its id): the URL, its pool, and its request's first bytes
        (`_begun`)."""
        self._swept = time.monotonic()

    async def post(self, url: yarl.URL, *, data: bytes, headers: dict[str, str]) -> Answer:
        """`data` posted to `url` with `headers` (besides Host, Content-Length and, unless
        given, `Accept: */*`, as aiohttp's client sends): the answer begun."""
        # By the URL object's identity: a URL hashes in Python, and the forwarder asks
        # with the same few objects again and again (the entry holds its URL: its id is
        # not another's while it is kept).
        got = self._by_url.get(id(url))
        if got is None:
            got = self._begun(url)
        _, pool, start = got
        # A kept connection without a coroutine to wait on (most requests); else one made.
        c = pool.kept() or await pool.connection()
        head = self.head_of(start, headers, len(data))
        try:
            return await c.send(head, data)
        except BaseException:
            c.close()
            raise

    def _begun(self, url: yarl.URL) -> tuple[yarl.URL, Pool, bytes]:
        """`url`'s pool and its request line and Host header, kept for the next request
        to it (the forwarder keeps each replica's URLs: the same few, again and again)."""
        pool = self._pool(url)
        start = b"POST %b HTTP/1.1\r\nHost: %b" % (
            (url.raw_path_qs or "/").encode(),
            pool.authority,
        )
        if len(self._by_url) >= MAX_KEPT:
            self._by_url.clear()
        got = self._by_url[id(url)] = (url, pool, start)
        return got

    def _pool(self, url: yarl.URL) -> Pool:
        key = (url.scheme, url.raw_host, url.port)
        pool = self.pools.get(key)
        if pool is None:
            loop = asyncio.get_running_loop()
            pool = self.pools[key] = Pool(
                loop, url, self.connect_timeout_s, self.read_timeout_s, self.readers
            )
            self._sweep()
        return pool

    def _sweep(self) -> None:
        """Pools with nothing open dropped (replicas come and go over months); at most
        once a minute, as a new pool is made."""
        now = time.monotonic()
        if now - self._swept < 60:
            return
        self._swept = now
        for k, p in list(self.pools.items()):
            if not p.open:
                del self.pools[k]
        self._by_url.clear()  # none kept of a pool dropped

    async def close(self) -> None:
        for p in self.pools.values():
            p.close()
        self.pools.clear()
        self._by_url.clear()
