"""The gateway: an OpenAI-compatible request path to the replicas the log says are ready.

Run by `llmgw gateway` (services/cli/gateway.py) and by `llmgw up` beside the
dashboard. It follows the log with the one follow loop and ingest every reader uses
(`services.follower.ViewFollower`), so what it routes to is the folded view: a replica
leaves routing the instant its drain is folded (`services.core.routing`). It serves
`POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and `GET /v1/models`.

A gateway is a pipe (STYLE.md): of a request it parses only `model`, `stream`,
`stream_options`, `user` and what its key's `tpm` reserves (`max_tokens`,
`max_completion_tokens`, `n`: `services.gateway.tokens`); the body goes to the replica byte for byte, and a streamed
answer comes back chunk by chunk as the replica sends it, never re-encoded. One
exception: a stream whose client did not ask for its usage chunk is asked for it, and
the chunk taken out of what the client gets (`services.gateway.streams`). A refusal is
in the OpenAI error shape, `{"error": {"message", "type", "code"}}`, with the reason in
an `x-llmgw-reason` header: 400 malformed JSON or no model (or a `stream` that is not a
boolean: `invalid_type`, naming it), 401 no valid API key, 429 a key over its rpm or tpm (`services.core.ratelimit`; Retry-After, and the limit in words
after the code), 404 an unknown model (with a did-you-mean) or another tenant's
(`services.gateway.scope`), 405 a method the path has not, 408 a body that does not arrive in time,
413 a body over `max_body`, 502 a replica that answered garbage, 503 no replica can
serve now (with Retry-After), 504 a replica that did not answer in time. Before any of
that, the edge (`services.gateway.guard`): 421 a `Host` it does not answer for, 403 a
request from another origin, 415 a body not said to be JSON, 503 a body past
`body_budget` (the bytes of bodies held at once, with Retry-After). A request
that fails before its first byte (connection refused, reset, a 503 from the server) is
tried once more on another replica; a client that goes away cancels its upstream
request at once.

The HTTP stack is aiohttp, server and client: measured against uvicorn+httptools with
the same aiohttp client on one loaded 2-core host, the two were within each other's
noise (docs/gateway.md); one library then handles both sides, and its handler
cancellation is what turns a client's disconnect into a cancelled upstream request.

A model that cannot take a request now does not refuse it: the request waits in the
model's line (`services.gateway.waiting`: each key's owner in turn), up to
`queue_per_model`, for as long as
the model's start is predicted to take (`services.core.coldstart`) and no longer than
the client waits; a held stream is sent its 200 and SSE comments (`: waiting`) every
`keepalive_s` meanwhile. While requests wait the gateway publishes `model.demanded`
(at once for the first, then at most once a second), which is what wakes an on-demand
model from zero. The fold of a replica's ready releases the line, at most
`target_inflight` x `INFLIGHT_FACTOR` in flight a replica, the rest as requests end.
Past the line's length or its wait, a 429 with Retry-After the predicted start; a model
the plane has said it cannot place, a 503 with that decision's reason.

Use is a fact: for each replica it served, the gateway publishes `replica.used` with the
requests and tokens (from the answers' `usage`) since its last report, at most once per
`used_interval_s`, on the replica's node subject as its agent would, and per owner of
the API keys that sent them (`by_owner`); each request's owner is in its span too.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import socket
import time
from collections import deque
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
from schemas import inflight, subjects
from services import listen, names
from services.bus import Publisher, tracing
from services.bus.errors import BusError
from services.bus.replies import ReplyGuard
from services.clock import new_id, utc_now
from services.core import catalog, coldstart, ratelimit, routing
from services.follower import ViewFollower
from services.gateway import guard, plane, scope, streams, tokens
from services.gateway.config import Config
from services.gateway.errors import GatewayError
from services.gateway.keys import Key, Keys
from services.gateway.listen import (
    BODY_BUDGET,
    DEFAULT_LISTEN,
    KEEPALIVE_S,
    MAX_BODY,
    QUEUE_PER_MODEL,
    UPSTREAM_TIMEOUT_S,
    USED_INTERVAL_S,
)
from services.gateway.metrics import (
    CONTENT_TYPE,
    NO_OWNER,
    NOT_READ,
    UNKNOWN,
    KeptLabelled,
    Labelled,
    Metrics,
)
from services.gateway.waiting import Full, Line, Waiter, WaitingRoom

log = logging.getLogger("llmgw.gateway")

SOURCE = "gateway"
# Per-request values kept on the aiohttp request: the model's label and the arrival time.
_MODEL = web.RequestKey("llmgw_model", str)
_T0 = web.RequestKey("llmgw_t0", float)
_SPAN = web.RequestKey("llmgw_span", trace.Span)
# _PICKED_AT: the seq of the view a request's replica was picked from, said to the client
# in `x-llmgw-seq` (a drain folded at a seq past it had not been folded at the pick).
_PICKED_AT = web.RequestKey("llmgw_picked_at", int)
# _WOKEN: perf_counter() of the fold of the ready that released this request, when it
# was the first that ready released; its first byte then measures the wake.
_WOKEN = web.RequestKey("llmgw_woken", float)
# _STATUS: the status of a refusal sent inside a held stream's 200 (as an SSE error).
_STATUS = web.RequestKey("llmgw_status", int)
# _SENT: the replicas a woken request was sent to (its wake's send counted once).
_SENT = web.RequestKey("llmgw_sent", tuple)
_KEY = web.RequestKey("llmgw_key", Key)
# _TOOK: the tokens (prompt and completion) a request's answer took, what its key's
# reservation is settled to at its end.
_TOOK = web.RequestKey("llmgw_took", int)
# _HELD: the bytes of the budget (`guard.Budget`) this request's body holds.
_HELD = web.RequestKey("llmgw_held", int)
_BOUNDARY = web.AppKey("llmgw_boundary", guard.Boundary)

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
# SHUT_RETRY_S is the Retry-After of a key whose limit is 0 (it never refills).
SHUT_RETRY_S = 3600
# USED_TICK_S is how often the reporter looks for use to report (the interval, when it
# is shorter).
USED_TICK_S = 1.0
# TAIL_BYTES is how much of a stream's end is kept to read its usage chunk from.
TAIL_BYTES = 8192
# IDLE_TIMEOUT_S bounds how long a client's connection may go without a whole request:
# one that sends its headers a byte at a time (slowloris), or keeps an idle connection
# open, is closed then (nginx's keep-alive default), not held for aiohttp's hour.
IDLE_TIMEOUT_S = 75.0

# MIN_WAIT_S is the least a held request waits for a model with a history of starts: a
# model that loads in a second still needs the scheduler's pass and, to make room, a
# victim's drain (30 s by default) before its start even begins.
MIN_WAIT_S = 30.0
# DEMAND_INTERVAL_S is the least time between two `model.demanded` of one model.
DEMAND_INTERVAL_S = 1.0
# CLIENT_TIMEOUT_SHARE is how much of the timeout a client says it reads with (the
# openai package's `x-stainless-read-timeout`) a held request may spend waiting: it is
# answered 429 a little before the client would give up on it unanswered.
CLIENT_TIMEOUT_SHARE = 0.9

# SSE_HEADERS are a held stream's, sent when it starts waiting.
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
KEEPALIVE = b": waiting\n\n"

# _WAKES are the events after whose fold a line may be served: a replica ready (or one
# leaving, which frees nothing but changes who is routable), a node back, a model's
# declaration (its target_inflight).
_WAKES = (
    ev.ReplicaStateEvent,
    ev.ReplicaDrainEvent,
    ev.NodeUncordonedEvent,
    ev.NodeFoundEvent,
    ev.ModelDeclaredEvent,
)
# _VERDICTS are the events after whose fold a line may learn its model cannot be placed.
_VERDICTS = (ev.PreemptionDecidedEvent, ev.HoldCreatedEvent, ev.ModelRemovedEvent)

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

# NO_SPAN stands for a request's span when none is made: a span that records nothing,
# as the no-op tracer's would be, without the context it would be attached to.
NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)


class _Head(msgspec.Struct, forbid_unknown_fields=False):
    """What routing reads of a request; every other field is passed on unread."""

    model: Any = None
    stream: Any = False
    user: Any = None
    stream_options: Any = msgspec.UNSET
    max_tokens: Any = None
    max_completion_tokens: Any = None
    n: Any = None


_head = msgspec.json.Decoder(_Head)


class _Details(msgspec.Struct, forbid_unknown_fields=False):
    cached_tokens: int | None = None


class _Tokens(msgspec.Struct, forbid_unknown_fields=False):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


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


def _cached(doc: bytes) -> int | None:
    """The prompt tokens an answer's `usage` says the engine served from its prefix
    cache (`prompt_tokens_details.cached_tokens`: vLLM with
    `--enable-prompt-tokens-details`); None when it does not say."""
    try:
        u = _answer.decode(doc).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    d = None if u is None else u.prompt_tokens_details
    return None if d is None or d.cached_tokens is None else max(d.cached_tokens, 0)


def _stream_cached(tail: bytes) -> int | None:
    """`_cached` of a stream's last `data:` event with a usage."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line and b'"prompt_tokens"' in line:
            return _cached(line[6:])
    return None


def _stream_usage(tail: bytes) -> tuple[int, int] | None:
    """The usage of a stream's last `data:` event that has one (a client that asked for
    `stream_options.include_usage` gets such a chunk last); None without."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            got = _usage(line[6:])
            if got != (0, 0):
                return got
    return None


@dataclass
class _Use:
    """Use of one replica not reported yet."""

    node: str
    at: datetime
    requests: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    tokens_cached: int | None = None
    """Of `tokens_in`, those the answers said were served from the prefix cache."""
    owners: dict[str, list[int]] = field(default_factory=dict)
    """Per owner of the keys that sent them: [requests, tokens_in, tokens_out]."""
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
        words: str = "",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.param = param
        """The request's field at fault, as OpenAI's errors name it (`param`)."""
        self.status = status
        self.message = message
        self.reason = reason
        self.kind = kind
        self.headers = headers or {}
        self.words = words
        """For `x-llmgw-reason` after the code (`code: words`), when the code alone
        would not tell an operator which limit and for how long."""

    def response(self) -> web.Response:
        error: dict[str, Any] = {"message": self.message, "type": self.kind, "code": self.reason}
        if self.param is not None:
            error["param"] = self.param
        body = {"error": error}
        said = f"{self.reason}: {self.words}" if self.words else self.reason
        # A header is ASCII without control characters: an owner's name in other letters
        # is escaped there (the body's message keeps it as it is).
        said = "".join(
            c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii") for c in said
        )
        return web.json_response(
            body, status=self.status, headers={"x-llmgw-reason": said, **self.headers}
        )


class _Answered(Exception):
    """A held stream answered already (its refusal sent as an SSE error event)."""

    def __init__(self, resp: web.StreamResponse) -> None:
        super().__init__("answered")
        self.resp = resp


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
    by_model: dict[str, int] = field(default_factory=dict)
    """Requests per declared model (under its name, not an alias) since the start."""
    demanded: int = 0
    """`model.demanded` events published."""
    wakes: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    """Seconds from the fold of a ready to the first byte of the first request it
    released, latest last."""
    sends: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    """Seconds from the fold of a ready to the first request it released being sent to
    the replica: the gateway's own share of the wake."""


@dataclass
class Gateway:
    """The server: a follower of the log, a router, an HTTP client, and the aiohttp
    app that serves clients."""

    js: Any
    listen: str = DEFAULT_LISTEN
    root: str = subjects.DEFAULT_ROOT
    max_body: int = MAX_BODY
    body_budget: int = BODY_BUDGET
    """The bytes of request bodies held at once, all requests together (`--body-budget`);
    past it a new body is 503 with Retry-After (`guard.Budget`)."""
    allow_hosts: tuple[str, ...] = ()
    """`Host` names answered for besides loopback ones (`--allow-host`, `guard.Boundary`)."""
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
    queue_per_model: int = QUEUE_PER_MODEL
    keepalive_s: float = KEEPALIVE_S
    inflight_factor: float = routing.INFLIGHT_FACTOR
    min_wait_s: float = MIN_WAIT_S
    demand_interval_s: float = DEMAND_INTERVAL_S
    plane: tuple[str, ...] = ()
    """The plane's other listeners (the dashboard's, the broker's URL), whose ports no
    replica's endpoint may name; the gateway's own always counts (`plane.Ports`)."""
    nc: Any = None
    """The broker connection to answer draining agents on (`_answer_inflight`); None:
    agents get no answer from this gateway, and stop their servers without it."""
    id: str = field(default_factory=new_id)
    """This gateway's own id, new at every start, in its answers to agents."""
    settle_heap: bool = False
    """Freeze the heap again once serving (`settle_heap`): for a process of its own, as
    `freeze_heap` is, unless `--no-gc-freeze` or `--no-gc-tune`; never in a test process
    or `llmgw up`."""
    stream_usage: bool = True
    """Ask a server for the usage chunk of a stream whose client did not (and strip it);
    off (`--no-stream-usage`) for a server that refuses `stream_options`."""
    clock: Callable[[], float] = time.monotonic
    """The keys' limits' clock (seconds); a parameter so that tests need not wait."""
    fast_path: bool = True
    """The request path's speed-ups (`--no-fast-path` turns them off): no
    span made for a request when nothing records spans and the client sent no trace
    context (`_span`), and the metrics' labelled children kept (`KeptLabelled`)."""

    def __post_init__(self) -> None:
        self.labelled: Labelled = KeptLabelled() if self.fast_path else Labelled()
        self.follower = ViewFollower(
            self.js, root=self.root, consumer="gateway", on_change=self._on_fold
        )
        self.publisher = Publisher(self.js, self.root)
        self.room = WaitingRoom(self.queue_per_model)
        self.boundary = guard.Boundary(parse_listen(self.listen)[0], self.allow_hosts)
        self.budget = guard.Budget(self.body_budget)
        self.lines = guard.Lines(log)
        """The gateway's fault lines, one per cause then one per 30 s (`guard.Lines`)."""
        self._http: aiohttp.ClientSession | None = None
        self._use: dict[str, _Use] = {}
        self._stopping = False
        self._buckets: dict[bytes, ratelimit.Buckets] = {}
        """Per key with limits (by digest): its buckets. Bounded by the key file."""
        self._scope = scope.Scope()
        self._owners_seen: tuple[Any, ...] | None = None
        self._owners_said: str | None = None
        self._replies = ReplyGuard(f"gateway {self.id}: in-flight answers")
        self._plane = plane.Ports(self.plane)

    @classmethod
    def of(
        cls,
        js: Any,
        config: Config,
        *,
        root: str,
        keys: Keys | None = None,
        nc: Any = None,
        plane: tuple[str, ...] = (),
        own_process: bool = False,
    ) -> Gateway:
        """The gateway `config` describes (`llmgw gateway`, `python -m services.gateway`,
        `llmgw up`: the one place a gateway is made from an operator's settings); `keys`,
        its `--api-keys` file read; `own_process`, a process that is only the gateway (it
        freezes its heap again once serving, as `config` allows)."""
        return cls(
            js,
            listen=config.listen,
            root=root,
            max_body=config.max_body,
            body_budget=config.body_budget,
            allow_hosts=config.allow_hosts,
            upstream_timeout_s=config.upstream_timeout_s,
            used_interval_s=config.used_interval_s,
            stream_usage=config.stream_usage,
            keys=keys,
            queue_per_model=config.queue_per_model,
            keepalive_s=config.keepalive_s,
            fast_path=config.fast_path,
            settle_heap=own_process and config.process.gc_freeze and config.gc_tune,
            nc=nc,
            plane=plane,
        )

    # ------------------------------------------------------------------ lifecycle

    def bind(self) -> socket.socket:
        sock, self.url = listen.bind(self.listen, DEFAULT_LISTEN, 1024, GatewayError)
        return sock

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_openai_errors])
        app[_BOUNDARY] = self.boundary
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
        self._plane = plane.Ports((self.url, *self.plane))
        await self.follower.load_snapshot()
        follow = self.follower.start()
        try:
            with contextlib.suppress(TimeoutError):
                await self.follower.caught_up(CATCH_UP_S)
            try:
                self._check_owners()
            except GatewayError:
                sock.close()
                raise
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    sock_connect=self.connect_timeout_s,
                    sock_read=self.upstream_timeout_s,
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
                # One session serves every client: a cookie one replica set must not be
                # sent again with another client's request.
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            runner = web.AppRunner(
                self.app(),
                access_log=None,
                logger=guard.ParserLog(self.lines, log),
                handler_cancellation=True,
                shutdown_timeout=2.0,
                keepalive_timeout=self.idle_timeout_s,
            )
            await runner.setup()
            await web.SockSite(runner, sock).start()
            answers = None
            if self.nc is not None:
                # Answered once the view has caught up: before, it would say of a replica
                # it has not folded yet that it routes nothing there, and then route there.
                answers = await self.nc.subscribe(
                    subjects.gateway_inflight_wildcard(self.root), cb=self._answer_inflight
                )
            log.info("gateway: serving %s/v1 from the view at seq %d", self.url, self.follower.seq)
            if self.settle_heap:
                settle_heap()
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
                if answers is not None:
                    with contextlib.suppress(nats.errors.Error):
                        await answers.unsubscribe()
                await runner.cleanup()
                await self._http.close()
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
                # The held requests went with the server; their demand reports end too.
                self._stopping = True
                demands = [line.demand for line in self.room.lines.values() if line.demand]
                for task in demands:
                    task.cancel()
                for task in demands:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                # What was served and not reported yet is reported on the way out.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2):
                        await self._publish_use(force=True)
        finally:
            await self.follower.stop()

    def _check_owners(self) -> None:
        """A key whose owner is not in the quota tree the log says (nor a declared
        model's owner) stops the gateway with one line naming its FILE:LINE."""
        if self.keys is None:
            return
        state = self.follower.view.state
        why = self.keys.outside(
            {o.name for o in state.quota}, {m.owner for m in state.models.values()}
        )
        if why is not None:
            raise GatewayError(why)
        self._owners_seen = (state.quota, len(state.models))

    def _recheck_owners(self) -> None:
        """Once the gateway serves, a quota tree that leaves a key's owner out is said
        once in the log (its requests are still served and counted for that owner)."""
        if self.keys is None:
            return
        state = self.follower.view.state
        seen = (state.quota, len(state.models))
        if seen == self._owners_seen:
            return
        self._owners_seen = seen
        why = self.keys.outside(
            {o.name for o in state.quota}, {m.owner for m in state.models.values()}
        )
        if why is not None and why != self._owners_said:
            log.warning("gateway: %s", why)
        self._owners_said = why

    def traffic(self) -> tuple[dict[str, int], dict[str, int]]:
        """Requests per model since the start, and requests in flight per model now:
        what a dashboard in the same process shows (services.dashboard.traffic)."""
        replicas = self.follower.view.replicas
        inflight: dict[str, int] = {}
        for rid, n in self.router.inflight.items():
            r = replicas.get(rid)
            if r is not None:
                inflight[r.model] = inflight.get(r.model, 0) + n
        return dict(self.counts.by_model), inflight

    # ------------------------------------------------------------------ handlers

    async def _answer_inflight(self, msg: Any) -> None:
        """A draining agent asks how many requests this gateway has in flight on one of
        its replicas, and whether it would still route new ones there
        (`services.agent.gateways`; docs/contract.md, "The gateways' in-flight counts").
        Answered only on a reply under the asking node's agent inbox, and only about a
        replica on that node (`services.bus.replies`): a question about another node's
        replica, or one whose reply goes elsewhere, gets no answer. A replica this view
        does not hold is answered as nothing in flight and not routable: nothing new
        goes to it, and a count of one it dropped names no node."""
        asked = subjects.inflight_asked(msg.subject)
        if asked is None:
            return
        node, rid = asked
        if not self._replies.allows(node, msg.subject, msg.reply):
            return
        view = self.follower.view
        r = view.replicas.get(rid)
        if r is not None and node not in r.nodes:
            self._replies.refuse(msg.subject, f"replica {rid} is not on node {node}")
            return
        answer = inflight.InflightAnswer(
            gateway=self.id,
            replica=rid,
            inflight=self.router.inflight.get(rid, 0) if r is not None else 0,
            routable=r is not None and routing.routable(view, r, new_session=False),
            seq=self.follower.seq,
        )
        with contextlib.suppress(nats.errors.Error):
            await msg.respond(inflight.encode(answer))

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
                "held": self.room.held_by_model(),
                "demanded": self.counts.demanded,
                "wake_ms": _summary(self.counts.wakes),
                "wake_send_ms": _summary(self.counts.sends),
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def _authorize(self, request: web.Request) -> Key | None:
        """The request's key; None with no keys configured. 401 else."""
        if self.keys is None:
            return None
        key = self.keys.find(request.headers.get("Authorization"))
        if key is None:
            raise Refusal(
                401,
                "no valid API key: send Authorization: Bearer KEY",
                "invalid_api_key",
                kind="invalid_request_error",
            )
        return key

    def _admit(self, key: Key, reserve: int, take: bool = True) -> float:
        """One more request of `key`, which may take `reserve` tokens, taken by its
        limits: the tokens reserved for it (settled by `_settle` at its end), or a 429
        saying which limit and for how long (`services.core.ratelimit`). Not `take`: only
        whether its rpm refuses it (known before its body is read; what it may take of
        its tpm is not), its buckets left as they are."""
        limits = key.limits if take else ratelimit.Limits(rpm=key.limits.rpm)
        if limits.rpm is None and limits.tpm is None:
            return 0.0
        a = ratelimit.admit(
            limits,
            self._buckets.get(key.digest, ratelimit.Buckets()),
            self.clock(),
            reserve if limits.tpm is not None else 0,
        )
        if a.over is None:
            if take:
                self._buckets[key.digest] = a.buckets
            return a.reserved
        # A limit of 0 never refills: the key is shut, and told to come back in an hour.
        shut = not math.isfinite(a.wait_s)
        retry = SHUT_RETRY_S if shut else max(1, math.ceil(a.wait_s))
        limits = key.limits
        if a.over == "rpm":
            said, kind = f"its {limits.rpm} requests a minute (rpm={limits.rpm})", "requests"
        else:
            said, kind = f"its {limits.tpm} tokens a minute (tpm={limits.tpm})", "tokens"
        then = "it may send none" if shut else f"try again in {retry}s"
        words = f"the key of {key.owner} is over {said}; {then}"
        self.labelled.of(self.metrics.limited, key.owner, a.over).inc()
        raise Refusal(
            429,
            # The client is told its key's limit in words, never where the keys file is
            # on the gateway's host or which line of it is theirs.
            f"rate limit: {words}",
            "rate_limit_exceeded",
            kind=kind,
            headers={"Retry-After": str(retry)},
            words=words,
        )

    def _settle(self, key: Key, reserved: float, took: int) -> None:
        """A request of `key` admitted with `reserved` tokens has ended having taken
        `took`: its key's token bucket settled to that."""
        if key.limits.tpm is None:
            return
        b = self._buckets.get(key.digest, ratelimit.Buckets())
        self._buckets[key.digest] = ratelimit.settle(key.limits, b, self.clock(), reserved, took)

    def _visible(self, key: Key | None, d: ev.ModelDeclared) -> bool:
        """Whether the request's key may use the declared model `d` (`services.gateway.scope`);
        every model without keys."""
        return key is None or self._scope.may_use(key.owner, d, self.follower.view.state.quota)

    async def _models(self, request: web.Request) -> web.Response:
        key = self._authorize(request)
        view = self.follower.view
        data = []
        for d in sorted(view.state.models.values(), key=lambda d: d.name):
            m = view.catalog.resolve(d.name)
            if m is None or not self._visible(key, d):
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
        request[_MODEL] = NOT_READ
        request[_T0] = t0
        status = 499  # the client went away before an answer (nginx's number for it)
        # One span a request, SERVER kind, a child of the client's traceparent if it sent
        # one; no-op (and next to free) unless tracing is set up (OTEL_* variables).
        with self._span(request) as span:
            request[_SPAN] = span
            owner = NO_OWNER
            refused: str | None = None
            try:
                resp = await self._route(request)
                status = request.get(_STATUS, resp.status)
                return resp
            except Refusal as e:
                status = e.status
                refused = e.reason
                span.set_attribute("llmgw.reason", e.reason)
                raise
            finally:
                if held := request.get(_HELD):
                    self.budget.give(held)
                model = request[_MODEL]
                if model != UNKNOWN:
                    self.counts.by_model[model] = self.counts.by_model.get(model, 0) + 1
                key = request.get(_KEY)
                if key is not None:
                    owner = key.owner
                    span.set_attribute("llmgw.owner", owner)
                span.set_attribute("http.response.status_code", status)
                span.set_attribute("gen_ai.request.model", model)
                labelled = self.labelled
                labelled.of(self.metrics.requests, model, str(status)).inc()
                if refused is not None:
                    labelled.of(self.metrics.errors, model, refused).inc()
                labelled.of(self.metrics.owner_requests, owner, str(status)).inc()
                labelled.of(self.metrics.duration, model).observe(time.perf_counter() - t0)

    def _span(self, request: web.Request) -> contextlib.AbstractContextManager[trace.Span]:
        """The request's span, made current: SERVER kind, a child of the client's
        `traceparent` when it sent one. With nothing recording spans (no exporter set)
        and no traceparent, the no-op tracer's span records nothing and carries no
        context, so the fast path makes none (13 us and a dozen objects a request, held
        as long as a stream)."""
        traced = "traceparent" in request.headers
        if self.fast_path and not traced and not tracing.enabled():
            return NO_SPAN
        return tracing.tracer().start_as_current_span(
            f"POST {request.path}",
            context=tracing.extract(request.headers) if traced else None,
            kind=trace.SpanKind.SERVER,
        )

    async def _route(self, request: web.Request) -> web.StreamResponse:
        key = self._authorize(request)
        if key is not None:
            request[_KEY] = key
            # A key over its rpm already is refused before its body is read.
            self._admit(key, 0, take=False)
        body = await self._read_body(request)
        request[_MODEL] = UNKNOWN  # read: until `_routed` names its model, none
        head = _parse(body)
        if key is None:
            return await self._routed(request, None, body, head)
        reserve = tokens.reservation(
            head.max_tokens,
            head.max_completion_tokens,
            head.n,
            len(body),
            completes=request.path != "/v1/embeddings",
        )
        try:
            reserved = self._admit(key, reserve)
        except Refusal:
            # Refused for its tpm, the body read: counted under its model, which only
            # `_routed` would have named (worked out here for a refusal alone, not for
            # every request).
            request[_MODEL] = self._label(head.model, key)
            raise
        try:
            return await self._routed(request, key, body, head)
        finally:
            if reserved or key.limits.tpm is not None:
                self._settle(key, reserved, request.get(_TOOK, 0))

    def _label(self, name: str, key: Key) -> str:
        """The model a request refused for its tpm counts under in the metrics: a
        declared model the key may use, by its name; anything else `(unknown)`."""
        view = self.follower.view
        m = view.catalog.resolve(name)
        if m is None:
            return UNKNOWN
        d = view.state.models.get(m.name)
        if d is not None and not self._visible(key, d):
            return UNKNOWN
        return m.name

    async def _routed(
        self, request: web.Request, key: Key | None, body: bytes, head: _Head
    ) -> web.StreamResponse:
        view = self.follower.view
        m = view.catalog.resolve(head.model)
        if m is not None and key is not None:
            d = view.state.models.get(m.name)
            if d is not None and not self._visible(key, d):
                # Another tenant's model is not there for this key: the same 404 as a
                # name nobody declared, and nothing done for it (no wait, no demand).
                m = None
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
            known = [
                n
                for d in view.state.models.values()
                if self._visible(key, d)
                for n in (d.name, *d.aliases)
            ]
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
        # strip: a stream whose client did not ask for its usage chunk is asked for it on
        # the client's behalf, and the chunk taken out of what the client gets.
        strip = (
            self.stream_usage
            and stream
            and request.path != "/v1/embeddings"
            and not streams.asked(head.stream_options)
        )
        if strip:
            body = streams.ask_for_usage(body, head.stream_options)
        limit = routing.admit_limit(view, m, self.inflight_factor)
        # Nobody overtakes a line: with requests of the model waiting, a new one joins
        # them, even if a slot has just freed (the line is served first).
        r = (
            None
            if self.room.waiting(m.name)
            else self.router.pick(view, m, session=session, limit=limit)
        )
        request[_PICKED_AT] = view.seq
        held: web.StreamResponse | None = None
        if r is None:
            try:
                r, held = await self._wait(request, m, session, stream, key)
            except _Answered as a:
                return a.resp
        try:
            return await self._send(request, m, r, body, stream, strip, session, held)
        except Refusal as e:
            if held is None:
                raise
            # A held stream has had its 200: the refusal goes as the stream's one
            # event, in the error shape the openai package raises from.
            await _sse_error(request, held, e)
            return held

    async def _send(
        self,
        request: web.Request,
        m: catalog.Model,
        first: Any,
        body: bytes,
        stream: bool,
        strip: bool,
        session: str | None,
        held: web.StreamResponse | None,
    ) -> web.StreamResponse:
        """Send the request to `first` (picked and counted in flight), and once more to
        another replica if it fails before its first byte."""
        tried: list[str] = []
        last: _Unreachable | None = None
        span = request[_SPAN]
        r = first
        for attempt in range(2):
            if attempt:
                r = self.router.pick(
                    self.follower.view,
                    m,
                    session=session,
                    avoid=tried,
                    limit=routing.admit_limit(self.follower.view, m, self.inflight_factor),
                )
                if r is None:
                    break
                request[_PICKED_AT] = self.follower.seq
            tried.append(r.id)
            span.set_attribute("llmgw.replica", r.id)
            if attempt:
                self.counts.retries += 1
                self.metrics.retries.inc()
                span.set_attribute("llmgw.retry", True)
            else:
                self.metrics.overhead.observe(time.perf_counter() - request[_T0])
            inflight = self.labelled.of(self.metrics.inflight, m.name)
            inflight.inc()
            try:
                return await self._forward(request, r, body, stream, strip, held)
            except _Unreachable as e:
                self.lines.say(
                    logging.INFO,
                    ("unreachable", r.id),
                    "gateway: %s: %s%s",
                    r.id,
                    e,
                    "; trying another" if not attempt else "",
                )
                last = e
            finally:
                inflight.dec()
                self._done(r)
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

    def _done(self, r: Any) -> None:
        """A request sent to `r` has ended: its slot frees, and the line of its model
        (if any waits) is served from it."""
        self.router.done(r.id)
        if not self.room.lines:
            return
        m = self.follower.view.catalog.resolve(r.model)
        line = None if m is None else self.room.lines.get(m.name)
        if line is not None and len(line):
            self._serve(line)

    # ------------------------------------------------------------------ waiting room

    async def _wait(
        self,
        request: web.Request,
        m: catalog.Model,
        session: str | None,
        stream: bool,
        key: Key | None = None,
    ) -> tuple[Any, web.StreamResponse | None]:
        """Hold the request in its model's line until a replica can take it: the
        replica (counted in flight) and, for a stream, the 200 already sent. A Refusal
        past the line's length or its wait, or for a model that cannot be placed."""
        view = self.follower.view
        now = utc_now()
        line = self.room.lines.get(m.name)
        since = line.since if line is not None and line.since is not None else now
        # A model with replicas to route to is busy, not unplaced: its requests wait for
        # a slot, whatever the plane says of placing more.
        routed = bool(routing.candidates(view, m))
        # Replicas on a lost node within its grace: counted live, so the plane places no
        # other until the grace ends, and nothing a request waits 30 s for. Said at once,
        # naming the node, with when a replica should be there again.
        lost = None if routed else coldstart.stranded(view, m, now)
        if lost is not None:
            said = lost.words(m.name, now)
            raise Refusal(
                503,
                said,
                "node_lost",
                kind="api_error",
                headers={"Retry-After": str(lost.retry_after)},
                words=said,
            )
        cannot = None if routed else coldstart.unplaceable(view, m, now, since)
        if cannot is not None:
            raise _unplaceable(cannot)
        look = coldstart.outlook(view, m, now, floor_s=self.min_wait_s)
        bound = look.bound_s
        told = _client_timeout(request) if not stream else None
        if told is not None:
            bound = min(bound, told * CLIENT_TIMEOUT_SHARE)
        try:
            w = self.room.join(m, session, now, None if key is None else key.owner)
        except Full as full:
            if full.owner is None:
                said = (
                    f"{self.room.per_model} requests already wait for {m.name}, the most "
                    "one model may have waiting; it should be ready in about "
                    f"{look.retry_after}s"
                )
            else:
                said = (
                    f"the share of {full.owner} of the line for {m.name} is full: it has "
                    f"{full.held} of the {self.room.per_model} requests that may wait "
                    f"({full.share} a tenant while others wait); it should be ready in "
                    f"about {look.retry_after}s"
                )
            raise Refusal(
                429,
                said,
                "queue_full",
                kind="rate_limit_error",
                headers={"Retry-After": str(look.retry_after)},
                words=said,
            ) from None
        if w.displaced is not None:
            self._displace(w.displaced, m, look.retry_after)
        line = self.room.lines[m.name]
        span = request[_SPAN]
        span.set_attribute("llmgw.held", True)
        held_gauge = self.labelled.of(self.metrics.held, m.name)
        held_gauge.inc()
        if line.demand is None:
            line.demand = asyncio.create_task(self._demand(line), name=f"demand {m.name}")
        self._serve(line)  # a slot may be free behind requests that have left
        resp: web.StreamResponse | None = None
        taken = False
        try:
            if stream and not w.fut.done():
                resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
                await resp.prepare(request)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + bound
            while not w.fut.done():
                left = deadline - loop.time()
                if left <= 0:
                    break
                step = left if resp is None else min(left, self.keepalive_s)
                await asyncio.wait((w.fut,), timeout=step)
                if not w.fut.done() and resp is not None and loop.time() < deadline:
                    await resp.write(KEEPALIVE)
            if not w.fut.done():
                self.room.leave(w)
                after = coldstart.outlook(self.follower.view, m, utc_now(), floor_s=0)
                said = (
                    f"{m.name} was not ready within the {bound:.0f}s this request could "
                    f"wait; it should be ready in about {after.retry_after}s"
                )
                raise Refusal(
                    429,
                    said,
                    "not_ready_in_time",
                    kind="rate_limit_error",
                    headers={"Retry-After": str(after.retry_after)},
                    words=said,
                )
            r = w.fut.result()  # a Refusal given to the whole line raises here
            request[_PICKED_AT] = w.seq
            taken = True
            if w.woken_at is not None:
                request[_WOKEN] = w.woken_at
            return r, resp
        except Refusal as e:
            if resp is None:
                raise
            await _sse_error(request, resp, e)
            raise _Answered(resp) from None
        finally:
            held_gauge.dec()
            if not taken:
                self.room.leave(w)
                if w.fut.done() and not w.fut.cancelled() and w.fut.exception() is None:
                    # Released to a replica as the client went away: its slot is free.
                    self._done(w.fut.result())
                elif not w.fut.done():
                    w.fut.cancel()

    def _displace(self, w: Waiter, m: catalog.Model, retry_after: int) -> None:
        """`w` pushed out of a full line for a request of an owner under its share."""
        w.displaced = None
        if w.fut.done():
            return
        line = self.room.lines.get(m.name)
        share = self.room.per_model // max(1, len(line.queues) if line is not None else 1)
        said = (
            f"the share of {w.owner} of the line for {m.name} is full: {share} a tenant "
            f"while others wait, and another tenant's request took this one's place; it "
            f"should be ready in about {retry_after}s"
        )
        w.fut.set_exception(
            Refusal(
                429,
                said,
                "queue_full",
                kind="rate_limit_error",
                headers={"Retry-After": str(retry_after)},
                words=said,
            )
        )

    def _serve(self, line: Line) -> None:
        """Release the head of `line` to replicas with room, in order, each counted in
        flight as it is released; a model no longer declared refuses its line (404)."""
        view = self.follower.view
        m = view.catalog.resolve(line.model)
        if m is None:
            self._refuse(
                line,
                Refusal(
                    404,
                    f"the model {line.model!r} was removed while the request waited",
                    "unknown_model",
                ),
            )
            return
        limit = routing.admit_limit(view, m, self.inflight_factor)
        while len(line):
            w = line.head()
            if w.fut.done():
                line.pop()
                continue
            r = self.router.pick(view, m, session=w.session, limit=limit)
            if r is None:
                break
            line.pop()
            if line.woken_at is not None:
                w.woken_at, line.woken_at = line.woken_at, None
            w.seq = view.seq
            w.fut.set_result(r)

    def _refuse(self, line: Line, refusal: Refusal) -> None:
        while len(line):
            w = line.pop()
            if not w.fut.done():
                w.fut.set_exception(refusal)
        self.room.drop_if_idle(line)

    def _on_fold(self, seq: int, event: ev.Event, rejection: Any) -> None:
        """After each event the follower folds: with requests waiting, serve the lines a
        ready (or another change of who is routable) can serve, critical first, and
        refuse those of a model the plane has just said it cannot place."""
        if rejection is not None:
            return
        if isinstance(event, ev.ReplicaStateEvent) and event.data.state in ("stopped", "failed"):
            # A replica gone: when it was last picked is kept no more (one entry for every
            # replica ever picked, in a gateway that runs for months).
            r = self.follower.view.replicas.get(event.data.replica)
            if r is None or not r.holds_capacity:
                self.router.forget((event.data.replica,))
        if not self.room.lines:
            return
        if isinstance(event, ev.ReplicaStateEvent) and event.data.state == "ready":
            m = self.follower.view.catalog.resolve(event.data.model)
            line = None if m is None else self.room.lines.get(m.name)
            if line is not None and len(line):
                line.woken_at = time.perf_counter()
        if isinstance(event, _VERDICTS):
            view = self.follower.view
            now = utc_now()
            for line in list(self.room.ordered()):
                m = view.catalog.resolve(line.model)
                if m is None:
                    self._serve(line)  # refuses it
                    continue
                since = line.since
                cannot = (
                    None
                    if since is None or routing.candidates(view, m)
                    else coldstart.unplaceable(view, m, now, since)
                )
                if cannot is not None:
                    self._refuse(line, _unplaceable(cannot))
            return
        if isinstance(event, _WAKES):
            for line in list(self.room.ordered()):
                self._serve(line)

    async def _demand(self, line: Line) -> None:
        """Publish `model.demanded` for `line` at once, then at most once every
        `demand_interval_s` while it has requests waiting; once it empties, one with
        `waiting` 0 says the wait is over, and the task ends (the next request to wait
        starts another, published at once as the first of its wait)."""
        began = line.since
        try:
            while not self._stopping:
                since = line.since or began
                assert since is not None
                began = since
                waiting = len(line)
                view = self.follower.view
                m = view.catalog.resolve(line.model)
                inflight = 0
                if m is not None:
                    inflight = sum(
                        self.router.inflight.get(r.id, 0) for r in routing.candidates(view, m)
                    )
                e = ev.make(
                    ev.ModelDemanded(
                        model=line.model,
                        waiting=min(waiting, ev.MAX_REPLICAS),
                        since=since,
                        inflight=min(inflight, ev.MAX_REPLICAS),
                    ),
                    id=new_id(),
                    time=utc_now(),
                    source=SOURCE,
                )
                try:
                    await self.publisher.publish(e)
                    self.counts.demanded += 1
                    self.labelled.of(self.metrics.demanded, line.model).inc()
                except (BusError, nats.errors.Error) as err:
                    self.lines.say(
                        logging.WARNING,
                        ("demand", line.model),
                        "gateway: demand for %s not published: %s",
                        line.model,
                        err,
                    )
                if not waiting:
                    if len(line):
                        continue  # a request came while the end was being said
                    return
                # The next report a second on, or the end as soon as the line empties.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(line.emptied.wait(), self.demand_interval_s)
        finally:
            line.demand = None
            self.room.drop_if_idle(line)

    async def _read_body(self, request: web.Request) -> bytes:
        """The whole body, its bytes held in the budget (`_HELD`, given back by `_proxy`
        when the request ends): all of them before it is read when its length is said,
        else chunk by chunk as they come."""
        said = request.content_length
        if said is not None and said > self.max_body:
            raise _too_big(self.max_body)
        if said is not None:
            if not self.budget.take(said):
                raise self._over_budget()
            request[_HELD] = said
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
                    if said is None:
                        if not self.budget.take(len(chunk)):
                            raise self._over_budget()
                        request[_HELD] = size
                    chunks.append(chunk)
        except TimeoutError:
            raise Refusal(
                408, f"the body did not arrive within {self.body_timeout_s:g}s", "body_timeout"
            ) from None
        return b"".join(chunks)

    def _over_budget(self) -> Refusal:
        return Refusal(
            503,
            f"the gateway holds {self.budget.held} bytes of request bodies, its budget is "
            f"{self.budget.capacity} (--body-budget); try again shortly",
            "body_budget",
            kind="server_error",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    async def _forward(
        self,
        request: web.Request,
        r: Any,
        body: bytes,
        stream: bool,
        strip: bool = False,
        held: web.StreamResponse | None = None,
    ) -> web.StreamResponse:
        """Send `body` to `r` and pass its answer on; into `held` (a held stream's 200,
        already sent) when there is one."""
        assert self._http is not None
        headers = {h: request.headers[h] for h in FORWARDED if h in request.headers} | JSON_TYPE
        woken = request.get(_WOKEN)
        if woken is not None and r.id not in request.get(_SENT, ()):
            self.counts.sends.append(time.perf_counter() - woken)
            request[_SENT] = (r.id,)
        if self._plane.refuses(r.endpoint):
            raise _Unreachable(f"its endpoint {r.endpoint} is a port of the plane", garbage=False)
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
        # A stream's JSON events sent to its client, what it took if it is cut short
        # (`services.gateway.tokens`); `counted` once its use is.
        sent = 0
        counted = True
        try:
            if upstream.status == 503:
                # A server that says it cannot take it (draining, overloaded) has done
                # nothing with the request: another replica may.
                raise _Unreachable("it answered 503", garbage=False)
            out_headers = {h: upstream.headers[h] for h in PASSED if h in upstream.headers}
            out_headers["x-llmgw-replica"] = r.id
            out_headers["x-llmgw-seq"] = str(request.get(_PICKED_AT, 0))
            sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
            if held is not None and not (sse and upstream.status < 400):
                # The 200 is sent: what the replica said instead of a stream goes as
                # the stream's error event.
                data = await self._whole(upstream, r.id)
                raise Refusal(
                    502 if upstream.status < 400 else upstream.status,
                    f"replica {r.id} answered {upstream.status}: "
                    f"{data[:500].decode(errors='replace')}",
                    "bad_upstream" if upstream.status < 400 else "upstream_error",
                    kind="api_error",
                )
            if not stream or not sse:
                data = await self._whole(upstream, r.id)
                self._first_byte(request)
                if upstream.status < 400:
                    self._used(r, *_usage(data), request, cached=_cached(data))
                return web.Response(body=data, status=upstream.status, headers=out_headers)
            if held is None:
                resp = web.StreamResponse(status=upstream.status, headers=out_headers)
                await resp.prepare(request)
            else:
                resp = held
            # The stream's end, for its usage: extended in place and cut only past twice
            # its length, not copied whole for each chunk.
            tail = bytearray()
            first = True
            cut = streams.Strip() if strip else None
            counted = False
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
                    sent += tokens.events(chunk)
                    if first:
                        self._first_byte(request)
                        first = False
                if cut is not None and (rest := cut.end()):
                    await resp.write(rest)
                    sent += tokens.events(rest)
            except (aiohttp.ClientError, TimeoutError) as e:
                # Past the first byte there is no status left to change: the stream is
                # cut, and the client sees it end without `data: [DONE]`.
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
                    self._used(r, tokens.prompt_estimate(len(body)), sent, request)
                counted = True
                return resp
            if upstream.status < 400:
                if cut is not None:
                    used = cut.tokens
                    cached = None if cut.event is None else _stream_cached(cut.event)
                else:
                    used = _stream_usage(bytes(tail[-TAIL_BYTES:]))
                    cached = _stream_cached(bytes(tail[-TAIL_BYTES:])) if used else None
                # A stream that ended without its usage chunk is counted as one cut.
                self._used(
                    r,
                    *(used or (tokens.prompt_estimate(len(body)), sent)),
                    request,
                    cached=cached,
                )
            counted = True
            await resp.write_eof()
            return resp
        except BaseException:
            # However it ends early (a client gone, a cancel): the upstream request ends
            # with it, its connection closed, not returned to the pool half read; what
            # its client was sent of a stream is counted.
            upstream.close()
            if not counted and upstream.status < 400:
                self._used(r, tokens.prompt_estimate(len(body)), sent, request)
            raise
        finally:
            upstream.release()

    def _first_byte(self, request: web.Request) -> None:
        t = time.perf_counter()
        self.labelled.of(self.metrics.first_byte, request[_MODEL]).observe(t - request[_T0])
        woken = request.get(_WOKEN)
        if woken is not None:
            self.counts.wakes.append(t - woken)
            self.metrics.wake.observe(t - woken)

    # ------------------------------------------------------------------ use

    def _used(
        self,
        r: Any,
        tokens_in: int,
        tokens_out: int,
        request: web.Request | None = None,
        cached: int | None = None,
    ) -> None:
        """Count one request `request` that `r` answered, for its next `replica.used`,
        and what it took for its key's limit (settled as it ends); `cached` of its
        prompt tokens the engine said it served from its prefix cache."""
        key = None if request is None else request.get(_KEY)
        if request is not None:
            request[_TOOK] = tokens_in + tokens_out
        u = self._use.get(r.id)
        now = utc_now()
        if u is None:
            u = self._use[r.id] = _Use(node=r.shards[0].node if r.shards else "", at=now)
        u.at, u.requests = now, u.requests + 1
        u.tokens_in += tokens_in
        u.tokens_out += tokens_out
        if cached is not None:
            u.tokens_cached = (u.tokens_cached or 0) + cached
        if key is None:
            return
        o = u.owners.setdefault(key.owner, [0, 0, 0])
        o[0] += 1
        o[1] += tokens_in
        o[2] += tokens_out
        self.labelled.of(self.metrics.owner_tokens, key.owner, "in").inc(tokens_in)
        self.labelled.of(self.metrics.owner_tokens, key.owner, "out").inc(tokens_out)

    async def _report_use(self, stop: asyncio.Event) -> None:
        tick = min(self.used_interval_s, USED_TICK_S)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), tick)
            await self._publish_use()
            self._recheck_owners()

    async def _publish_use(self, force: bool = False) -> None:
        """One `replica.used` for each replica with use not reported, at most one per
        `used_interval_s` (unless `force`), on its node's subject like its agent's."""
        now_m = time.monotonic()
        for rid, u in list(self._use.items()):
            if not u.requests or not u.node:
                continue
            if not force and now_m - u.reported < self.used_interval_s:
                continue
            by_owner = {
                o: ev.OwnerUse(requests=n[0], tokens_in=n[1], tokens_out=n[2])
                for o, n in u.owners.items()
                if n[0]
            }
            e = ev.make(
                ev.ReplicaUsed(
                    replica=rid,
                    at=u.at,
                    requests=u.requests,
                    tokens_in=u.tokens_in,
                    tokens_out=u.tokens_out,
                    tokens_cached=u.tokens_cached,
                    by_owner=by_owner,
                ),
                id=new_id(),
                time=utc_now(),
                source=SOURCE,
            )
            sent = (u.requests, u.tokens_in, u.tokens_out)
            sent_cached = u.tokens_cached
            try:
                await self.publisher.publish(e, node=u.node)
            except (BusError, nats.errors.Error) as err:
                self.lines.say(
                    logging.WARNING,
                    ("use", rid),
                    "gateway: use of %s not reported yet: %s",
                    rid,
                    err,
                )
                continue
            # Requests that ended while it was being published are the next report's.
            u.requests -= sent[0]
            u.tokens_in -= sent[1]
            u.tokens_out -= sent[2]
            if sent_cached is not None and u.tokens_cached is not None:
                u.tokens_cached = u.tokens_cached - sent_cached if u.requests else None
            for o, d in by_owner.items():
                n = u.owners[o]
                n[0] -= d.requests
                n[1] -= d.tokens_in
                n[2] -= d.tokens_out
                if not n[0]:
                    del u.owners[o]
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
    # Read as the server will, or refused: a server that reads `"stream": "true"` as true
    # streams an answer the gateway would pass, and count, as a whole one.
    if head.stream.__class__ is not bool:
        if head.stream is not None:
            raise _invalid_type("stream", "a boolean", head.stream)
        head.stream = False
    if head.max_tokens is not None and not _tokens(head.max_tokens):
        raise _invalid_type("max_tokens", _TOKENS, head.max_tokens)
    if head.max_completion_tokens is not None and not _tokens(head.max_completion_tokens):
        raise _invalid_type("max_completion_tokens", _TOKENS, head.max_completion_tokens)
    return head


_TOKENS = "a whole number of tokens (0 or more)"


def _tokens(value: Any) -> bool:
    return value.__class__ is int and value >= 0


_JSON_TYPES = {str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def _invalid_type(field: str, expected: str, value: Any) -> Refusal:
    """400 for a field of the request the gateway reads and the server would read
    otherwise, in the shape of OpenAI's own (`code` invalid_type, `param` the field)."""
    got = _JSON_TYPES.get(type(value), "an object" if isinstance(value, dict) else "a list")
    if isinstance(value, int | float) and not isinstance(value, bool):
        got = f"{value!r:.20}"
    return Refusal(
        400,
        f"invalid type for `{field}`: expected {expected}, got {got}",
        "invalid_type",
        param=field,
    )


def _answer_too_big(rid: str) -> Refusal:
    return Refusal(
        502, f"replica {rid} answered over {MAX_ANSWER} bytes", "bad_upstream", kind="api_error"
    )


def _summary(xs: deque[float]) -> dict[str, float]:
    """How many, and the median and 99th percentile in ms, of the latest wakes."""
    if not xs:
        return {"n": 0}
    got = sorted(xs)
    n = len(got)
    return {
        "n": n,
        "p50": round(got[n // 2] * 1e3, 3),
        "p99": round(got[min(n - 1, int(n * 0.99))] * 1e3, 3),
    }


def _unplaceable(u: coldstart.Unplaceable) -> Refusal:
    headers = {}
    if u.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(u.retry_after_s)))
    return Refusal(503, u.reason, u.code, kind="api_error", headers=headers, words=u.reason)


def _client_timeout(request: web.Request) -> float | None:
    """The seconds the client says it waits for an answer (the openai package sends its
    read timeout as `x-stainless-read-timeout`); None when it says nothing usable."""
    raw = request.headers.get("x-stainless-read-timeout")
    if raw is None:
        return None
    try:
        t = float(raw)
    except ValueError:
        return None
    return t if math.isfinite(t) and t > 0 else None


async def _sse_error(request: web.Request, resp: web.StreamResponse, e: Refusal) -> None:
    """`e` as the one SSE event of a stream whose 200 is sent (`data: {"error": ...}`,
    which the openai package raises as an APIError), and the stream's end; the request's
    status and span say the refusal, as a refusal before the 200 would."""
    request[_STATUS] = e.status
    request[_SPAN].set_attribute("llmgw.reason", e.reason)
    doc = {"error": {"message": e.message, "type": e.kind, "code": e.reason}}
    with contextlib.suppress(ConnectionError, RuntimeError):
        await resp.write(b"data: " + msgspec.json.encode(doc) + b"\n\n")
        await resp.write_eof()


def _too_big(limit: int) -> Refusal:
    return Refusal(413, f"the body is over {limit} bytes", "body_too_large")


def freeze_heap(config: Config) -> bool:
    """Move every object alive now (the imported modules, most of what a gateway process
    holds) out of the cyclic collector's reach, and collect with `config.gc_thresholds`;
    whether it did. `--no-gc-freeze` turns it off; `--no-gc-tune` keeps CPython's
    thresholds.

    Called once by a gateway process of its own (`llmgw gateway`, `python -m
    services.gateway`) before it serves, never by `Gateway` itself: a test process or
    `llmgw up` holds other things. A full collection walks every tracked object, and
    with 300 streams open one took 30-110 ms, a stall of the loop that every stream
    then waiting paid for; frozen, 25-40 ms (docs/gateway.md). The cost: a frozen
    object that later becomes part of a cycle is never freed, and nothing frozen here
    is meant to die.
    """
    if not config.process.gc_freeze:
        return False
    gc.collect()
    gc.freeze()
    if config.gc_tune:
        gc.set_threshold(*config.gc_thresholds)
    return True


def settle_heap() -> bool:
    """Freeze again what a gateway process holds once it serves (its view of the log,
    its server, its pools): long-lived objects the first freeze came too early for;
    whether it did. Only a gateway whose `settle_heap` is set calls it (`Gateway.of`:
    a process of its own, unless `--no-gc-freeze` or `--no-gc-tune`)."""
    gc.collect()
    gc.freeze()
    return True


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:8322` for IPv6) -> (host, port); ValueError with a message."""
    return listen.parse(text, DEFAULT_LISTEN)


@web.middleware
async def _openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every refusal in the OpenAI error shape, aiohttp's own (404, 405) included."""
    try:
        why = request.app[_BOUNDARY].refusal(request)
        if why is not None:
            raise Refusal(*why)
        return await handler(request)
    except Refusal as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        reason = {404: "not_found", 405: "method_not_allowed"}.get(e.status, "bad_request")
        return Refusal(e.status, f"{request.method} {request.path}: {e.reason}", reason).response()
