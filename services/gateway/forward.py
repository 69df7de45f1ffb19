"""Forwarding: one request's body to its replica, and the replica's answer back.

Used by `services.gateway.server` once a request has its replica. The body goes byte
for byte (the client's headers but `FORWARDED` stay at the gateway), and a streamed
answer comes back chunk by chunk as the replica sends it, never re-encoded; a stream
whose client did not ask for its usage chunk has it taken out (`services.gateway.streams`).
A replica that fails before its first byte (connection refused, reset, a 503 from the
server) is `Unreachable`, for the server to try another once; a client that goes away
cancels its upstream request at once. What each answer took is counted as it ends
(`Forwarder.used`), from its `usage` or, for a stream cut short, from what was sent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import yarl

from services.gateway import continuation, guard, plane, streams, tokens
from services.gateway.exchange import (
    Answer,
    FirstByte,
    Request,
    Stream,
    Whole,
    begin,
    send_now,
    sent_now,
)
from services.gateway.metrics import Counts
from services.gateway.refusal import (
    MAX_ANSWER,
    Refusal,
    Unreachable,
    answer_too_big,
)
from services.gateway.request import PICKED_AT, ROUTED, SENT, WOKEN
from services.gateway.upstream import Body, ConnectFailed, LeanSession, NotHttp
from services.gateway.use import stream_cached, stream_usage, use_of

# TAIL_BYTES is how much of a stream's end is kept to read its usage chunk from.
TAIL_BYTES = 8192

# MAX_URLS bounds the replicas' URLs kept parsed (`Forwarder._urls`).
MAX_URLS = 4096

# FORWARDED are the request headers a replica gets; the client's others (its key
# first of all) stay at the gateway. Content-Type is not among them: the gateway has
# read the body as a JSON object, so the replica is told `application/json` whatever
# the client said (curl's `-d` says form-urlencoded).
FORWARDED = ("Accept", "X-Request-Id")
JSON_TYPE = {"Content-Type": "application/json"}
# PASSED are the answer headers a client gets from the replica.
PASSED = ("Content-Type", "Cache-Control", "X-Request-Id")

# Used is what counts one answered request: (replica, tokens in, tokens out, request).
Used = Callable[[Any, int, int, Request, int | None], None]


@dataclass(eq=False)
class Forwarder:
    """The gateway's client side: its pool of connections to the replicas (`http`, set
    while it serves), its timeouts, and what it calls as answers begin and end."""

    connect_timeout_s: float
    upstream_timeout_s: float
    lines: guard.Lines
    counts: Counts
    first_byte: FirstByte
    """Called at an answer's first byte (or after, with the time it came)."""
    used: Used
    """Called once an answer that was not an error has ended, however it ended."""
    ports: plane.Ports = field(default_factory=lambda: plane.Ports(()))
    """The plane's own ports, which no request is sent to."""
    client: str = "lean"
    """The upstream client (`--upstream-client`): `lean` (`services.gateway.upstream`) or
    `aiohttp` (its `ClientSession`, the reference)."""
    readers: Any = None
    """The lean client's read callbacks compiled (`relay.Picked.readers`), or None."""
    http: aiohttp.ClientSession | LeanSession | None = None
    _urls: dict[tuple[str, str], yarl.URL] = field(default_factory=dict)
    """Each replica's endpoint and path as a parsed URL, kept (parsed once, not for each
    request); emptied past MAX_URLS (replicas come and go over months)."""

    def open(
        self, connect_timeout_s: float, upstream_timeout_s: float
    ) -> aiohttp.ClientSession | LeanSession:
        """The one client session every request is forwarded on (the caller closes it),
        with its timeouts: the lean client's, or aiohttp's (`client`)."""
        self.connect_timeout_s = connect_timeout_s
        self.upstream_timeout_s = upstream_timeout_s
        if self.client == "lean":
            self.http = LeanSession(connect_timeout_s, upstream_timeout_s, self.readers)
            return self.http
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=connect_timeout_s, sock_read=upstream_timeout_s
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            # One session serves every client: a cookie one replica set must not be
            # sent again with another client's request.
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        return self.http

    async def forward(
        self,
        request: Request,
        r: Any,
        body: bytes,
        stream: bool,
        strip: bool = False,
        held: Stream | None = None,
    ) -> Answer:
        """Send `body` to `r` and pass its answer on; into `held` (a held stream's 200,
        already sent) when there is one."""
        woken = request.get(WOKEN)
        if woken is not None and r.id not in request.get(SENT, ()):
            self.counts.sends.append(time.perf_counter() - woken)
            request[SENT] = (r.id,)
        upstream = await self._post(request, r, body)
        # However it ends early (a client gone, a cancel), the upstream request ends with
        # it, its connection closed, not returned to the pool half read, and what its
        # client was sent of a stream is counted: [the stream's JSON events sent to its
        # client, whether its use is counted (or is not to be: all but a stream begun)].
        sent = [0, 1]
        try:
            return await self._answer(request, r, body, upstream, stream, strip, held, sent)
        except BaseException:
            upstream.close()
            if not sent[1] and upstream.status < 400:
                self.used(r, tokens.prompt_estimate(len(body)), sent[0], request, None)
            raise
        finally:
            upstream.release()

    async def _post(
        self, request: Request, r: Any, body: bytes, path: str | None = None
    ) -> aiohttp.ClientResponse:
        """The replica's answer begun: its status and headers; `Unreachable` when it
        cannot be asked, 504 when it does not answer in time. `path`: another than the
        request's (a stream continued by token ids goes on on `/v1/completions`)."""
        assert self.http is not None
        if self.ports.refuses(r.endpoint):
            raise Unreachable(f"its endpoint {r.endpoint} is a port of the plane", garbage=False)
        # Loops, not comprehensions (each a call of its own in this Python): every request
        # passes here.
        said, headers = request.headers, {}
        for h in FORWARDED:
            if (v := said.get(h)) is not None:
                headers[h] = v
        headers.update(JSON_TYPE)
        path = path or request.path
        url = self._urls.get((r.endpoint, path))
        if url is None:
            if len(self._urls) >= MAX_URLS:
                self._urls.clear()
            url = self._urls[r.endpoint, path] = yarl.URL(f"{r.endpoint}{path}")
        try:
            # The lean client's answer is read through the attributes of aiohttp's that
            # the forwarder and the continuation read (`services.gateway.upstream.Answer`).
            answer: aiohttp.ClientResponse = await self.http.post(  # type: ignore[assignment]
                url, data=body, headers=headers
            )
            return answer
        except ConnectFailed as e:
            raise Unreachable(
                f"cannot connect: {e.os_error.strerror or e}", garbage=False
            ) from None
        except NotHttp as e:
            raise Unreachable(f"not HTTP: {e.message}", garbage=True) from None
        except TimeoutError as e:
            if isinstance(e, aiohttp.ConnectionTimeoutError):
                raise Unreachable(
                    f"no connection within {self.connect_timeout_s:g}s", garbage=False
                ) from None
            raise Refusal(
                504,
                f"replica {r.id} did not answer within {self.upstream_timeout_s:g}s",
                "upstream_timeout",
                kind="api_error",
            ) from None
        except aiohttp.ClientConnectorError as e:
            raise Unreachable(
                f"cannot connect: {e.os_error.strerror or e}", garbage=False
            ) from None
        except aiohttp.ServerDisconnectedError:
            raise Unreachable("it closed the connection", garbage=False) from None
        except aiohttp.ClientResponseError as e:
            raise Unreachable(f"not HTTP: {e.message}", garbage=True) from None
        except aiohttp.ClientError as e:
            raise Unreachable(f"{type(e).__name__}: {e}", garbage=True) from None

    async def _answer(
        self,
        request: Request,
        r: Any,
        body: bytes,
        upstream: aiohttp.ClientResponse,
        stream: bool,
        strip: bool,
        held: Stream | None,
        sent: list[int],
    ) -> Answer:
        """Pass on an answer begun: whole, or as a stream."""
        if upstream.status == 503:
            # A server that says it cannot take it (draining, overloaded) has done
            # nothing with the request: another replica may.
            raise Unreachable("it answered 503", garbage=False)
        sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        if held is not None and not (sse and upstream.status < 400):
            # The 200 is sent: what the replica said instead of a stream goes as the
            # stream's error event.
            data = await self.whole(upstream, r.id)
            raise Refusal(
                502 if upstream.status < 400 else upstream.status,
                f"replica {r.id} answered {upstream.status}: {data[:500].decode(errors='replace')}",
                "bad_upstream" if upstream.status < 400 else "upstream_error",
                kind="api_error",
            )
        out_headers: dict[str, str] = {}
        for h in PASSED:
            if (v := upstream.headers.get(h)) is not None:
                out_headers[h] = v
        out_headers["x-llmgw-replica"] = r.id
        out_headers["x-llmgw-seq"] = str(request.get(PICKED_AT, 0))
        if (said := request.get(ROUTED)) is not None:
            out_headers["x-llmgw-route"] = said
        if not stream or not sse:
            # Taken, and sent, without a coroutine each where all of it has come (most).
            got = self._taken(upstream, r.id)
            data = got if got is not None else await self.whole(upstream, r.id)
            came = time.perf_counter()
            # Sent before it is counted: the client waits for none of what follows.
            answer = Whole(data, upstream.status, out_headers)
            answered = sent_now(request, answer) or await send_now(request, answer)
            self.first_byte(request, came)
            if upstream.status < 400:
                tokens_in, tokens_out, saved = use_of(data)
                self.used(r, tokens_in, tokens_out, request, saved)
            return answered
        if held is None:
            resp = await begin(request, upstream.status, out_headers)
        else:
            resp = held
        # --- continuation (services.gateway.continuation): a stream that may survive
        # its replica is passed on there, event by event.
        plan: continuation.Plan | None = request.get(continuation.PLAN)
        if plan is not None:
            return await plan.stream(self, request, r, upstream, resp, strip, sent)
        # --- end continuation
        return await self._stream(request, r, body, upstream, resp, strip, sent)

    async def _stream(
        self,
        request: Request,
        r: Any,
        body: bytes,
        upstream: aiohttp.ClientResponse,
        resp: Stream,
        strip: bool,
        sent: list[int],
    ) -> Stream:
        """Pass a stream on chunk by chunk; count its use at its end, from its usage
        chunk, or from what was sent when it has none or is cut (a stream that may be
        continued is passed on by its `continuation.Plan` instead: `_answer`)."""
        # The stream's end, for its usage: extended in place and cut only past twice its
        # length, not copied whole for each chunk.
        tail = bytearray()
        first = True
        cut = streams.Strip() if strip else None
        sent[1] = 0
        try:
            async for chunk in upstream.content.iter_any():
                if cut is not None:
                    chunk = cut.feed(chunk)
                    if not chunk:
                        continue
                else:
                    tail += chunk
                    if len(tail) > 2 * TAIL_BYTES:
                        del tail[:-TAIL_BYTES]
                await resp.write(chunk)
                sent[0] += tokens.events(chunk)
                if first:
                    self.first_byte(request)
                    first = False
            if cut is not None and (rest := cut.end()):
                await resp.write(rest)
                sent[0] += tokens.events(rest)
        except (aiohttp.ClientError, TimeoutError) as e:
            # Past the first byte there is no status left to change: the stream is cut,
            # and the client sees it end without `data: [DONE]`.
            self.lines.say(
                logging.WARNING,
                ("cut", r.id),
                "gateway: %s: stream cut: %s",
                r.id,
                type(e).__name__,
            )
            upstream.close()
            if request.transport is not None:
                request.transport.close()
            if upstream.status < 400:
                self.used(r, tokens.prompt_estimate(len(body)), sent[0], request, None)
            sent[1] = 1
            return resp
        if upstream.status < 400:
            if cut is not None:
                used = cut.tokens
                saved = None if cut.event is None else stream_cached(cut.event)
            else:
                used = stream_usage(bytes(tail[-TAIL_BYTES:]))
                saved = stream_cached(bytes(tail[-TAIL_BYTES:])) if used else None
            # A stream that ended without its usage chunk is counted as one cut.
            self.used(r, *(used or (tokens.prompt_estimate(len(body)), sent[0])), request, saved)
        sent[1] = 1
        await resp.write_eof()
        return resp

    def _taken(self, upstream: aiohttp.ClientResponse, rid: str) -> bytes | None:
        """The lean client's answer, all of it come, taken in one call (502 past
        MAX_ANSWER); None when it has not all come, or is aiohttp's (`whole` reads it)."""
        content = upstream.content
        if not isinstance(content, Body):
            return None
        if upstream.content_length is not None and upstream.content_length > MAX_ANSWER:
            raise answer_too_big(rid)
        got = content.taken_whole()
        if got is not None and len(got) > MAX_ANSWER:
            raise answer_too_big(rid)
        return got

    async def whole(self, upstream: aiohttp.ClientResponse, rid: str) -> bytes:
        """The whole answer, read to its end (a `read(n)` returns only what has come so
        far); 502 past MAX_ANSWER or when the replica breaks it off."""
        try:
            if (got := self._taken(upstream, rid)) is not None:
                return got
            if upstream.content_length is not None and upstream.content_length > MAX_ANSWER:
                raise answer_too_big(rid)
            chunks: list[bytes] = []
            size = 0
            while chunk := await upstream.content.readany():
                size += len(chunk)
                if size > MAX_ANSWER:
                    raise answer_too_big(rid)
                chunks.append(chunk)
            return b"".join(chunks)
        except TimeoutError:
            raise Refusal(
                504,
                f"replica {rid} stopped answering for {self.upstream_timeout_s:g}s",
                "upstream_timeout",
                kind="api_error",
            ) from None
        except aiohttp.ClientError as e:
            raise Refusal(
                502,
                f"replica {rid} broke off its answer: {type(e).__name__}",
                "bad_upstream",
                kind="api_error",
            ) from None
