"""The gateway: an OpenAI-compatible request path to the replicas the log says are ready.

Run by `llmgw gateway` (services/cli/gateway.py) and by `llmgw up` beside the
dashboard. It follows the log with the one follow loop and ingest every reader uses
(`services.follower.ViewFollower`), so what it routes to is the folded view: a replica
leaves routing the instant its drain is folded (`services.core.routing`). It serves
`POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and `GET /v1/models`.

A gateway is a pipe (STYLE.md): of a request it parses only `model`, `stream` and
`user`; the body goes to the replica byte for byte, and a streamed answer comes back
chunk by chunk as the replica sends it, never re-encoded. A refusal is in the OpenAI
error shape, `{"error": {"message", "type", "code"}}`, with the reason in an
`x-llmgw-reason` header: 400 malformed JSON or no model, 404 an unknown model (with a
did-you-mean), 405 a method the path has not, 408 a body that does not arrive in time,
413 a body over `max_body`, 502 a replica that answered garbage, 503 no replica can
serve now (with Retry-After), 504 a replica that did not answer in time. A request
that fails before its first byte (connection refused, reset, a 503 from the server) is
tried once more on another replica; a client that goes away cancels its upstream
request at once.

The HTTP stack is aiohttp, server and client: measured against uvicorn+httptools with
the same aiohttp client on one loaded 2-core host, the two were within each other's
noise (README, "The gateway"); one library then handles both sides, and its handler
cancellation is what turns a client's disconnect into a cancelled upstream request.

Use is a fact: for each replica it served, the gateway publishes `replica.used` with the
requests and tokens (from the answers' `usage`) since its last report, at most once per
`used_interval_s`, on the replica's node subject as its agent would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp
import msgspec
import nats.errors
from aiohttp import web
from opentelemetry import trace

from schemas import events as ev
from schemas import subjects
from services import listen, names
from services.bus import Publisher, tracing
from services.bus.errors import BusError
from services.clock import new_id, utc_now
from services.core import routing
from services.follower import ViewFollower
from services.gateway.errors import GatewayError
from services.gateway.keys import Keys
from services.gateway.listen import (
    DEFAULT_LISTEN,
    MAX_BODY,
    UPSTREAM_TIMEOUT_S,
    USED_INTERVAL_S,
)
from services.gateway.metrics import CONTENT_TYPE, UNKNOWN, Metrics

log = logging.getLogger("llmgw.gateway")

SOURCE = "gateway"
# Per-request values kept on the aiohttp request: the model's label and the arrival time.
_MODEL = web.RequestKey("llmgw_model", str)
_T0 = web.RequestKey("llmgw_t0", float)
_SPAN = web.RequestKey("llmgw_span", trace.Span)

# MAX_ANSWER bounds a non-streamed answer read whole from a replica (64 MiB: a batch of
# embeddings); past it the answer is garbage to the gateway (502).
MAX_ANSWER = 64 * 1024 * 1024
# BODY_TIMEOUT_S bounds the wait for a client's body: a body that never ends is a 408,
# not a connection held for ever.
BODY_TIMEOUT_S = 30.0
# CONNECT_TIMEOUT_S bounds a connection to a replica; one that takes longer is tried
# once more elsewhere, like a refused one.
CONNECT_TIMEOUT_S = 5.0
# RETRY_AFTER_S is what a 503 tells a client to wait: about a scheduler pass.
RETRY_AFTER_S = 1
# USED_TICK_S is how often the reporter looks for use to report (the interval, when it
# is shorter).
USED_TICK_S = 1.0
# TAIL_BYTES is how much of a stream's end is kept to read its usage chunk from.
TAIL_BYTES = 8192
# IDLE_TIMEOUT_S bounds how long a client's connection may go without a whole request:
# one that sends its headers a byte at a time (slowloris), or keeps an idle connection
# open, is closed then (nginx's keep-alive default), not held for aiohttp's hour.
IDLE_TIMEOUT_S = 75.0
# CATCH_UP_S bounds the wait, at start, for the view to reach the end of the log; the
# gateway serves with what it has folded after that rather than not at all.
CATCH_UP_S = 30.0

# FORWARDED are the request headers a replica gets; the client's others (its key
# first of all) stay at the gateway. Content-Type is not among them: the gateway has
# read the body as a JSON object, so the replica is told `application/json` whatever
# the client said (curl's `-d` says form-urlencoded).
FORWARDED = ("Accept", "X-Request-Id")
JSON_TYPE = {"Content-Type": "application/json"}
# PASSED are the answer headers a client gets from the replica.
PASSED = ("Content-Type", "Cache-Control", "X-Request-Id")

# MAX_NAME is the longest model name the contract allows (schemas.events.Name).
MAX_NAME = 253

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class _Head(msgspec.Struct, forbid_unknown_fields=False):
    """What routing reads of a request; every other field is passed on unread."""

    model: Any = None
    stream: Any = False
    user: Any = None


_head = msgspec.json.Decoder(_Head)


class _Tokens(msgspec.Struct, forbid_unknown_fields=False):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Answer(msgspec.Struct, forbid_unknown_fields=False):
    """What use reports read of an answer: its `usage`, nothing else."""

    usage: _Tokens | None = None


_answer = msgspec.json.Decoder(_Answer)


def _usage(doc: bytes) -> tuple[int, int]:
    """(prompt, completion) tokens an answer's `usage` says; (0, 0) when it says none."""
    try:
        u = _answer.decode(doc).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0, 0
    return (0, 0) if u is None else (max(u.prompt_tokens, 0), max(u.completion_tokens, 0))


def _stream_usage(tail: bytes) -> tuple[int, int]:
    """The usage of a stream's last `data:` event that has one (a client that asked for
    `stream_options.include_usage` gets such a chunk last); (0, 0) without."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            return _usage(line[6:])
    return 0, 0


@dataclass
class _Use:
    """Use of one replica not reported yet."""

    node: str
    at: datetime
    requests: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    reported: float = -math.inf
    """When (monotonic) its last report was stored."""


class Refusal(Exception):
    """A request refused: the status, the OpenAI error fields, the reason header."""

    def __init__(
        self,
        status: int,
        message: str,
        reason: str,
        *,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.kind = kind
        self.headers = headers or {}

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.kind, "code": self.reason}}
        return web.json_response(
            body, status=self.status, headers={"x-llmgw-reason": self.reason, **self.headers}
        )


class _Unreachable(Exception):
    """A replica failed before its first byte: worth one more try elsewhere."""

    def __init__(self, why: str, *, garbage: bool) -> None:
        super().__init__(why)
        self.garbage = garbage


@dataclass
class Counts:
    """What the gateway has done, for tests and for /health."""

    requests: int = 0
    retries: int = 0
    refused: dict[int, int] = field(default_factory=dict)


@dataclass
class Gateway:
    """The server: a follower of the log, a router, an HTTP client, and the aiohttp
    app that serves clients."""

    js: Any
    listen: str = DEFAULT_LISTEN
    root: str = subjects.DEFAULT_ROOT
    max_body: int = MAX_BODY
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    upstream_timeout_s: float = UPSTREAM_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S
    used_interval_s: float = USED_INTERVAL_S
    url: str = ""
    """http://HOST:PORT, once bound."""
    router: routing.Router = field(default_factory=routing.Router)
    counts: Counts = field(default_factory=Counts)
    metrics: Metrics = field(default_factory=Metrics)
    keys: Keys | None = None
    """API keys; None: every request is taken (loopback, or --no-auth)."""

    def __post_init__(self) -> None:
        self.follower = ViewFollower(self.js, root=self.root, consumer="gateway")
        self.publisher = Publisher(self.js, self.root)
        self._http: aiohttp.ClientSession | None = None
        self._use: dict[str, _Use] = {}

    # ------------------------------------------------------------------ lifecycle

    def bind(self) -> socket.socket:
        sock, self.url = listen.bind(self.listen, DEFAULT_LISTEN, 1024, GatewayError)
        return sock

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_openai_errors])
        for path in PATHS:
            app.router.add_post(path, self._proxy)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def run(
        self,
        stop: asyncio.Event,
        sock: socket.socket | None = None,
        on_ready: Callable[[str], Any] | None = None,
    ) -> None:
        """Follow the log and serve until `stop`."""
        sock = sock or self.bind()
        await self.follower.load_snapshot()
        follow = self.follower.start()
        try:
            with contextlib.suppress(TimeoutError):
                await self.follower.caught_up(CATCH_UP_S)
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    sock_connect=self.connect_timeout_s,
                    sock_read=self.upstream_timeout_s,
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
            runner = web.AppRunner(
                self.app(),
                access_log=None,
                handler_cancellation=True,
                shutdown_timeout=2.0,
                keepalive_timeout=self.idle_timeout_s,
            )
            await runner.setup()
            await web.SockSite(runner, sock).start()
            log.info("gateway: serving %s/v1 from the view at seq %d", self.url, self.follower.seq)
            if on_ready is not None:
                on_ready(self.url)
            reporter = asyncio.create_task(self._report_use(stop), name="gateway: use")
            try:
                stopper = asyncio.create_task(stop.wait())
                await asyncio.wait([stopper, follow], return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if follow.done() and not stop.is_set():
                    follow.result()  # raises what stopped it
                    raise GatewayError("the gateway's follower of the log stopped")
            finally:
                await runner.cleanup()
                await self._http.close()
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
                # What was served and not reported yet is reported on the way out.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2):
                        await self._publish_use(force=True)
        finally:
            await self.follower.stop()

    # ------------------------------------------------------------------ handlers

    async def _health(self, request: web.Request) -> web.Response:
        """The view's seq, what is routable per declared model, in flight per replica."""
        view = self.follower.view
        routable = {}
        for name in sorted(view.state.models):
            m = view.catalog.resolve(name)
            if m is not None:
                routable[name] = sorted(r.id for r in routing.candidates(view, m))
        return web.json_response(
            {
                "seq": self.follower.seq,
                "routable": routable,
                "inflight": self.router.inflight,
                "requests": self.counts.requests,
                "retries": self.counts.retries,
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def _authorize(self, request: web.Request) -> str | None:
        """The owner of the request's key; None with no keys configured. 401 else."""
        if self.keys is None:
            return None
        owner = self.keys.owner(request.headers.get("Authorization"))
        if owner is None:
            raise Refusal(
                401,
                "no valid API key: send Authorization: Bearer KEY",
                "invalid_api_key",
                kind="invalid_request_error",
            )
        return owner

    async def _models(self, request: web.Request) -> web.Response:
        self._authorize(request)
        view = self.follower.view
        data = []
        for d in sorted(view.state.models.values(), key=lambda d: d.name):
            m = view.catalog.resolve(d.name)
            if m is None:
                continue
            ready = len(routing.candidates(view, m))
            for name in (m.name, *(a for a in m.aliases if view.catalog.resolve(a) is m)):
                data.append(
                    {
                        "id": name,
                        "object": "model",
                        "created": int(d.name != name),
                        "owned_by": m.owner,
                        "root": m.name,
                        "llmgw": {"replicas": ready},
                    }
                )
        return web.json_response({"object": "list", "data": data})

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        self.counts.requests += 1
        t0 = time.perf_counter()
        request[_MODEL] = UNKNOWN
        request[_T0] = t0
        status = 499  # the client went away before an answer (nginx's number for it)
        # One span a request, SERVER kind, a child of the client's traceparent if it sent
        # one; no-op (and next to free) unless tracing is set up (OTEL_* variables).
        with tracing.tracer().start_as_current_span(
            f"POST {request.path}",
            context=tracing.extract(request.headers) if "traceparent" in request.headers else None,
            kind=trace.SpanKind.SERVER,
        ) as span:
            request[_SPAN] = span
            try:
                resp = await self._route(request)
                status = resp.status
                return resp
            except Refusal as e:
                status = e.status
                span.set_attribute("llmgw.reason", e.reason)
                raise
            finally:
                model = request[_MODEL]
                span.set_attribute("http.response.status_code", status)
                span.set_attribute("gen_ai.request.model", model)
                self.metrics.requests.labels(model, str(status)).inc()
                self.metrics.duration.labels(model).observe(time.perf_counter() - t0)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        self._authorize(request)
        body = await self._read_body(request)
        head = _parse(body)
        view = self.follower.view
        m = view.catalog.resolve(head.model)
        if m is None and len(head.model) > MAX_NAME:
            # No model has such a name, and comparing one this long with every name
            # would hold the loop (difflib is quadratic): said without a did-you-mean.
            raise Refusal(
                404,
                f"the model {head.model[:64]!r}... does not exist (a name is at most "
                f"{MAX_NAME} characters; this one is {len(head.model)})",
                "unknown_model",
                kind="invalid_request_error",
            )
        if m is None:
            known = [n for d in view.state.models.values() for n in (d.name, *d.aliases)]
            hint = names.did_you_mean(head.model, known)
            raise Refusal(
                404,
                f"the model {head.model!r} does not exist{hint}",
                "unknown_model",
                kind="invalid_request_error",
            )
        request[_MODEL] = m.name
        session = request.headers.get("x-session-id") or (
            head.user if isinstance(head.user, str) and head.user else None
        )
        stream = head.stream is True
        tried: list[str] = []
        last: _Unreachable | None = None
        for attempt in range(2):
            r = self.router.pick(view, m, session=session, avoid=tried)
            if r is None:
                break
            tried.append(r.id)
            span = request[_SPAN]
            span.set_attribute("llmgw.replica", r.id)
            if attempt:
                self.counts.retries += 1
                self.metrics.retries.inc()
                span.set_attribute("llmgw.retry", True)
            else:
                self.metrics.overhead.observe(time.perf_counter() - request[_T0])
            inflight = self.metrics.inflight.labels(m.name)
            inflight.inc()
            try:
                return await self._forward(request, r, body, stream)
            except _Unreachable as e:
                log.info("gateway: %s: %s%s", r.id, e, "; trying another" if not attempt else "")
                last = e
            finally:
                inflight.dec()
                self.router.done(r.id)
        if last is not None and last.garbage:
            raise Refusal(
                502, f"the replica answered garbage: {last}", "bad_upstream", kind="api_error"
            )
        why = (
            f"no replica of {m.name} answered ({last})"
            if last is not None
            else f"no replica of {m.name} is ready now"
        )
        raise Refusal(
            503,
            why,
            "no_replica",
            kind="api_error",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    async def _read_body(self, request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > self.max_body:
            raise _too_big(self.max_body)
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    chunk = await request.content.readany()
                    if not chunk:
                        break
                    size += len(chunk)
                    if size > self.max_body:
                        raise _too_big(self.max_body)
                    chunks.append(chunk)
        except TimeoutError:
            raise Refusal(
                408, f"the body did not arrive within {self.body_timeout_s:g}s", "body_timeout"
            ) from None
        return b"".join(chunks)

    async def _forward(
        self, request: web.Request, r: Any, body: bytes, stream: bool
    ) -> web.StreamResponse:
        assert self._http is not None
        headers = {h: request.headers[h] for h in FORWARDED if h in request.headers} | JSON_TYPE
        try:
            upstream = await self._http.post(
                f"{r.endpoint}{request.path}", data=body, headers=headers
            )
        except TimeoutError as e:
            if isinstance(e, aiohttp.ConnectionTimeoutError):
                raise _Unreachable(
                    f"no connection within {self.connect_timeout_s:g}s", garbage=False
                ) from None
            raise Refusal(
                504,
                f"replica {r.id} did not answer within {self.upstream_timeout_s:g}s",
                "upstream_timeout",
                kind="api_error",
            ) from None
        except aiohttp.ClientConnectorError as e:
            raise _Unreachable(
                f"cannot connect: {e.os_error.strerror or e}", garbage=False
            ) from None
        except aiohttp.ServerDisconnectedError:
            raise _Unreachable("it closed the connection", garbage=False) from None
        except aiohttp.ClientResponseError as e:
            raise _Unreachable(f"not HTTP: {e.message}", garbage=True) from None
        except aiohttp.ClientError as e:
            raise _Unreachable(f"{type(e).__name__}: {e}", garbage=True) from None
        try:
            if upstream.status == 503:
                # A server that says it cannot take it (draining, overloaded) has done
                # nothing with the request: another replica may.
                raise _Unreachable("it answered 503", garbage=False)
            out_headers = {h: upstream.headers[h] for h in PASSED if h in upstream.headers}
            out_headers["x-llmgw-replica"] = r.id
            if not stream or not upstream.headers.get("Content-Type", "").startswith(
                "text/event-stream"
            ):
                data = await self._whole(upstream, r.id)
                self._first_byte(request)
                if upstream.status < 400:
                    self._used(r, *_usage(data))
                return web.Response(body=data, status=upstream.status, headers=out_headers)
            resp = web.StreamResponse(status=upstream.status, headers=out_headers)
            await resp.prepare(request)
            tail = b""
            first = True
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                    if first:
                        self._first_byte(request)
                        first = False
                    tail = (tail + chunk)[-TAIL_BYTES:]
            except (aiohttp.ClientError, TimeoutError) as e:
                # Past the first byte there is no status left to change: the stream is
                # cut, and the client sees it end without `data: [DONE]`.
                log.warning("gateway: %s: stream cut: %s", r.id, type(e).__name__)
                upstream.close()
                if request.transport is not None:
                    request.transport.close()
                return resp
            await resp.write_eof()
            if upstream.status < 400:
                self._used(r, *_stream_usage(tail))
            return resp
        except BaseException:
            # However it ends early (a client gone, a cancel): the upstream request ends
            # with it, its connection closed, not returned to the pool half read.
            upstream.close()
            raise
        finally:
            upstream.release()

    def _first_byte(self, request: web.Request) -> None:
        self.metrics.first_byte.labels(request[_MODEL]).observe(time.perf_counter() - request[_T0])

    # ------------------------------------------------------------------ use

    def _used(self, r: Any, tokens_in: int, tokens_out: int) -> None:
        """Count one request `r` answered, for its next `replica.used`."""
        u = self._use.get(r.id)
        now = utc_now()
        if u is None:
            u = self._use[r.id] = _Use(node=r.shards[0].node if r.shards else "", at=now)
        u.at, u.requests = now, u.requests + 1
        u.tokens_in += tokens_in
        u.tokens_out += tokens_out

    async def _report_use(self, stop: asyncio.Event) -> None:
        tick = min(self.used_interval_s, USED_TICK_S)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), tick)
            await self._publish_use()

    async def _publish_use(self, force: bool = False) -> None:
        """One `replica.used` for each replica with use not reported, at most one per
        `used_interval_s` (unless `force`), on its node's subject like its agent's."""
        now_m = time.monotonic()
        for rid, u in list(self._use.items()):
            if not u.requests or not u.node:
                continue
            if not force and now_m - u.reported < self.used_interval_s:
                continue
            e = ev.make(
                ev.ReplicaUsed(
                    replica=rid,
                    at=u.at,
                    requests=u.requests,
                    tokens_in=u.tokens_in,
                    tokens_out=u.tokens_out,
                ),
                id=new_id(),
                time=utc_now(),
                source=SOURCE,
            )
            sent = (u.requests, u.tokens_in, u.tokens_out)
            try:
                await self.publisher.publish(e, node=u.node)
            except (BusError, nats.errors.Error) as err:
                log.warning("gateway: use of %s not reported yet: %s", rid, err)
                continue
            # Requests that ended while it was being published are the next report's.
            u.requests -= sent[0]
            u.tokens_in -= sent[1]
            u.tokens_out -= sent[2]
            u.reported = time.monotonic()
        view = self.follower.view
        for rid in [rid for rid, u in self._use.items() if not u.requests]:
            r = view.replicas.get(rid)
            if r is None or not r.holds_capacity:
                del self._use[rid]

    async def _whole(self, upstream: aiohttp.ClientResponse, rid: str) -> bytes:
        """The whole answer, read to its end (a `read(n)` returns only what has come so
        far); 502 past MAX_ANSWER or when the replica breaks it off."""
        try:
            if upstream.content_length is not None and upstream.content_length > MAX_ANSWER:
                raise _answer_too_big(rid)
            chunks: list[bytes] = []
            size = 0
            while chunk := await upstream.content.readany():
                size += len(chunk)
                if size > MAX_ANSWER:
                    raise _answer_too_big(rid)
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


def _parse(body: bytes) -> _Head:
    """What routing reads of a body; 400 for anything but a JSON object. JSON is UTF-8
    throughout (RFC 8259), also in the fields the gateway skips; a key given twice
    counts as its last value, as it does for the replica's parser."""
    try:
        head = _head.decode(body)
        body.decode("utf-8")
    except msgspec.ValidationError:
        raise Refusal(400, "the body must be a JSON object", "invalid_json") from None
    except msgspec.DecodeError as e:
        raise Refusal(400, f"the body is not JSON: {e}", "invalid_json") from None
    except UnicodeDecodeError as e:
        raise Refusal(
            400, f"the body is not JSON: byte {e.start} is not UTF-8", "invalid_json"
        ) from None
    except RecursionError:
        raise Refusal(
            400, "the body is not JSON the gateway takes: nested too deep", "invalid_json"
        ) from None
    if not isinstance(head.model, str) or not head.model:
        raise Refusal(400, "the request names no model (a string `model` field)", "missing_model")
    return head


def _answer_too_big(rid: str) -> Refusal:
    return Refusal(
        502, f"replica {rid} answered over {MAX_ANSWER} bytes", "bad_upstream", kind="api_error"
    )


def _too_big(limit: int) -> Refusal:
    return Refusal(413, f"the body is over {limit} bytes", "body_too_large")


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:8322` for IPv6) -> (host, port); ValueError with a message."""
    return listen.parse(text, DEFAULT_LISTEN)


@web.middleware
async def _openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every refusal in the OpenAI error shape, aiohttp's own (404, 405) included."""
    try:
        return await handler(request)
    except Refusal as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        reason = {404: "not_found", 405: "method_not_allowed"}.get(e.status, "bad_request")
        return Refusal(e.status, f"{request.method} {request.path}: {e.reason}", reason).response()
