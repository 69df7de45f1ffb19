"""The gateway: an OpenAI-compatible request path to the replicas the log says are ready.

Run by `llmgw gateway` (services/cli/gateway.py), and by `llmgw up` as processes of its
own (`services.gateway.processes`, `services.gateway.supervised`). It follows the log with the one follow loop and ingest every reader uses
(`services.plane.follower.ViewFollower`), so what it routes to is the folded view: a replica
leaves routing the instant its drain is folded (`services.core.routing`). It serves
`POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and `GET /v1/models`.

This module is the HTTP surface: it reads a request (its key, its body, once, into a
`Head` and a route key: `services.gateway.request`), asks the routing rule for a replica
(a `services.core.routing.Picker`, the one `--routing` names), and hands the request on.
The rooms behind it: `services.gateway.forward` sends it and passes the answer back,
`services.gateway.holding` holds what cannot be served yet in its model's line,
`services.gateway.use` reports what each replica served (`replica.used`), and
`services.gateway.collector` tunes the collector of a gateway process of its own.

A refusal is in the OpenAI error shape, `{"error": {"message", "type", "code"}}`, with
the reason in an `x-llmgw-reason` header (`services.gateway.refusal`): 400 malformed JSON
or no model (or a `stream` that is not a boolean: `invalid_type`, naming it), 401 no
valid API key, 429 a key over its rpm or tpm (`services.core.ratelimit`; Retry-After, and
the limit in words after the code), 404 an unknown model (with a did-you-mean) or another
tenant's (`services.gateway.scope`), 405 a method the path has not, 408 a body that does
not arrive in time, 413 a body over `max_body`, 502 a replica that answered garbage, 503
no replica can serve now (with Retry-After), 504 a replica that did not answer in time.
Before any of that, the edge (`services.gateway.guard`): 421 a `Host` it does not answer
for, 403 a request from another origin, 415 a body not said to be JSON, 503 a body past
`body_budget` (the bytes of bodies held at once, with Retry-After). A request that fails
before its first byte is tried once more on another replica.

Each side of the HTTP stack is lean, on httptools, with aiohttp's as the reference it is
tested against (`--server`: `services.gateway.front`; `--upstream-client`:
`services.gateway.upstream`); the handlers see either server through
`services.gateway.exchange`. A client's disconnect cancels its handler, and so its
upstream request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN

from schemas import events as ev
from schemas import subjects
from services import listen
from services.bus import Publisher
from services.bus.fleet import Fleet
from services.bus.replies import ReplyGuard
from services.clock import new_id
from services.core import catalog, routing
from services.core import continuation as continuing
from services.core.pickers import DEFAULT_PICKER, PICKERS
from services.core.pickers import make as make_picker
from services.gateway import continuation, guard, pages, plane, relay, scope, share, streams, tokens
from services.gateway.admission import Admission, authorize
from services.gateway.collector import freeze_heap, settle_heap
from services.gateway.config import Config
from services.gateway.drains import Answers
from services.gateway.errors import GatewayError
from services.gateway.exchange import Answer, Request, Stream, Whole
from services.gateway.forward import Forwarder
from services.gateway.holding import DEMAND_INTERVAL_S, MIN_WAIT_S, Holding
from services.gateway.keys import Key, Keys
from services.gateway.listen import (
    BODY_BUDGET,
    DEFAULT_LISTEN,
    KEEPALIVE_S,
    MAX_BODY,
    QUEUE_PER_MODEL,
    SHARE_EXPIRY_S,
    SHARE_INTERVAL_S,
    UPSTREAM_TIMEOUT_S,
    USED_INTERVAL_S,
)
from services.gateway.loop import loop_name
from services.gateway.metrics import (
    CONTENT_TYPE,
    NO_OWNER,
    NOT_READ,
    UNKNOWN,
    Counts,
    KeptLabelled,
    Labelled,
    Metrics,
)
from services.gateway.metrics import sent as metrics_sent
from services.gateway.metrics import served as metrics_served
from services.gateway.refusal import Answered, Refusal, Routes, Unreachable, no_replica
from services.gateway.request import (
    HELD,
    KEY,
    MODEL,
    NO_SPAN,
    PICKED_AT,
    ROUTE,
    SPAN,
    STATUS,
    T0,
    TOOK,
    WOKEN,
    Head,
    body_now,
    parse,
    read_body,
    span_of,
    sse_error,
)
from services.gateway.request import route as route_of
from services.gateway.routed import Routed
from services.gateway.serving import Serving
from services.gateway.share import Sharing
from services.gateway.use import Uses
from services.gateway.waiting import WaitingRoom
from services.plane.follower import ViewFollower

__all__ = ["Counts", "Gateway", "Refusal", "freeze_heap", "parse_listen", "settle_heap"]

log = logging.getLogger("llmgw.gateway")


# BODY_TIMEOUT_S bounds the wait for a client's body: one that never ends is a 408.
BODY_TIMEOUT_S = 30.0
# CONNECT_TIMEOUT_S bounds a connection to a replica; one that takes longer is tried
# once more elsewhere, like a refused one.
CONNECT_TIMEOUT_S = 5.0
# IDLE_TIMEOUT_S bounds how long a client's connection may go without a whole request:
# one that sends its headers a byte at a time (slowloris), or keeps an idle connection
# open, is closed then (nginx's keep-alive default), not held for aiohttp's hour.
IDLE_TIMEOUT_S = 75.0

# CATCH_UP_S bounds the wait, at start, for the view to reach the end of the log; the
# gateway serves with what it has folded after that rather than not at all.
CATCH_UP_S = 30.0

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


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
    url: str = ""  # http://HOST:PORT, once bound
    router: routing.Picker = field(default_factory=PICKERS[DEFAULT_PICKER])
    """The routing rule (`--routing`: `PICKERS`)."""
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
    """The broker connection to answer draining agents on (`services.gateway.drains`); None:
    agents get no answer from this gateway, and stop their servers without it."""
    id: str = field(default_factory=new_id)  # its own, new at every start, said to agents
    settle_heap: bool = False
    """Freeze the heap again once serving (`settle_heap`): for a process of its own, as
    `freeze_heap` is (`llmgw gateway`, and each of `llmgw up`'s gateway processes), unless
    `--no-gc-freeze` or `--no-gc-tune`; never in a test process."""
    stream_usage: bool = True
    """Ask a server for the usage chunk of a stream whose client did not (and strip it);
    off (`--no-stream-usage`) for a server that refuses `stream_options`."""
    clock: Callable[[], float] = time.monotonic
    """The keys' limits' clock (seconds); a parameter so that tests need not wait."""
    continuation_limit: int = continuing.LIMIT
    """The moves one stream may make to another replica when its own breaks or drains
    (`--continuation-limit`; 0: none, a broken stream is cut): `gateway.continuation`."""
    continuation_settle_s: float = continuing.SETTLE_S
    """How long a continued stream on a replica whose drain is folded goes on there
    before it moves (`--continuation-settle`)."""
    fast_path: bool = True
    """The request path's speed-ups (`--no-fast-path` turns them off): no span made for a
    request when nothing records spans and the client sent no trace context (`_span`), the
    metrics' labelled children kept and written by writers of their own (`KeptLabelled`),
    the rule's own (`pickers.FAST`)."""
    chunk_relay: str = "auto"  # --chunk-relay: compiled or python (gateway.relay)
    upstream_client: str = "lean"  # --upstream-client: lean (gateway.upstream) or aiohttp
    server: str = "lean"  # --server: lean (gateway.front) or aiohttp (its web server)
    rule: str = DEFAULT_PICKER
    """The name of the routing rule `router` is (`--routing`), said as it starts serving."""
    share: bool = False
    """Share the keys' limits, the load and the prefix index with the other gateways on
    the broker `nc` (`services.gateway.share`; `Gateway.of` sets it from `--no-share`)."""
    share_interval_s: float = SHARE_INTERVAL_S
    share_expiry_s: float = SHARE_EXPIRY_S
    reuse_port: bool = False
    """Listen with SO_REUSEPORT: one of the gateway processes `llmgw up --gateways N`
    runs on one port (`services.gateway.processes`)."""
    fleet: Fleet | None = None
    """The gateways' fleet as this one hears it (`services.bus.fleet`), made with
    the gateway when it has a broker connection `nc` (else as `run` begins, if one was
    given since): from `run`'s start of serving it announces itself there, and says
    goodbye as it stops. Its `on_change` is free for what needs to know the fleet."""

    def __post_init__(self) -> None:
        self.labelled: Labelled = KeptLabelled() if self.fast_path else Labelled()
        if self.share and self.nc is not None:
            self.router = share.wrap(self.router)
        self.routed = Routed(self.router, self.metrics, self.labelled)
        # A rule that reads the prompt has it read with the head (`LeastInflight.reads_prompt`).
        self.reads_prompt = bool(getattr(self.router, "reads_prompt", False))
        self.follower = ViewFollower(
            self.js, root=self.root, consumer="gateway", on_change=self._on_fold
        )
        self.publisher = Publisher(self.js, self.root)
        self.room = WaitingRoom(self.queue_per_model)
        self.boundary = guard.Boundary(parse_listen(self.listen)[0], self.allow_hosts)
        self.budget = guard.Budget(self.body_budget)
        self.lines = guard.Lines(log)
        """The gateway's fault lines, one per cause then one per 30 s (`guard.Lines`)."""
        self.holding = Holding(
            view=self._view,
            router=self.router,
            room=self.room,
            publisher=self.publisher,
            metrics=self.metrics,
            labelled=self.labelled,
            counts=self.counts,
            lines=self.lines,
            settings=self,
        )
        relays = relay.pick(self.chunk_relay)
        self.forwarder = Forwarder(
            connect_timeout_s=self.connect_timeout_s,
            upstream_timeout_s=self.upstream_timeout_s,
            lines=self.lines,
            counts=self.counts,
            first_byte=self._first_byte,
            used=self._used,
            ports=plane.Ports(self.plane),
            client=self.upstream_client,
            readers=relays.readers,
        )
        self.uses = Uses(
            publisher=self.publisher,
            view=self._view,
            metrics=self.metrics,
            labelled=self.labelled,
            lines=self.lines,
            interval_s=self.used_interval_s,
        )
        self.continuations = continuation.Continuations(
            limit=self.continuation_limit,
            view=self._view,
            router=self.router,
            holding=self.holding,
            uses=self.uses,
            lines=self.lines,
            inflight_factor=self.inflight_factor,
            settle_s=self.continuation_settle_s,
            fast=self.fast_path,
            relay=relays.make,
        )
        self.admission = Admission(self.labelled, self.metrics)
        self._buckets = self.admission.buckets
        """Per key with limits (by digest): its buckets. Bounded by the key file."""
        self._scope = scope.Scope()
        self.sharing: Sharing | None = share.attach(self)
        replies = ReplyGuard(f"gateway {self.id}: in-flight answers")
        self.answers = Answers(self.id, self._view, self.router, replies)
        if self.nc is not None and self.fleet is None:
            self.fleet = Fleet(self.nc, self.root, me=pages.announcement(self))

    def _view(self) -> Any:
        return self.follower.view

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
        pickers: Mapping[str, Callable[[], routing.Picker]] = PICKERS,
    ) -> Gateway:
        """The gateway `config` describes (`llmgw gateway`, `python -m services.gateway`,
        `llmgw up`: the one place a gateway is made from an operator's settings); `keys`, its
        `--api-keys` file read; `own_process`, a process that is only the gateway (it freezes
        its heap again once serving, as `config` allows); `pickers`, the rules it names."""
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
            upstream_client=config.upstream_client,
            chunk_relay=config.chunk_relay,
            server=config.server,
            continuation_limit=config.continuation_limit,
            continuation_settle_s=config.continuation_settle_s,
            share=config.share,
            share_interval_s=config.share_interval_s,
            share_expiry_s=config.share_expiry_s,
            router=make_picker(config.routing, fast=config.fast_path, rules=pickers),
            rule=config.routing,
            settle_heap=own_process and config.process.gc_freeze and config.gc_tune,
            nc=nc,
            plane=plane,
        )

    # ------------------------------------------------------------------ lifecycle

    def bind(self) -> socket.socket:
        sock, self.url = listen.bind(
            self.listen, DEFAULT_LISTEN, 1024, GatewayError, reuse_port=self.reuse_port
        )
        return sock

    def routes(self) -> Routes:
        """The gateway's paths and their handlers, for either server."""
        routes: dict[str, dict[str, Callable[[Request], Awaitable[Answer]]]] = {
            path: {"POST": self._proxy} for path in PATHS
        }
        routes["/v1/models"] = {"GET": self._models}
        routes["/health"] = {"GET": self._health}
        routes["/metrics"] = {"GET": self._metrics}
        return routes

    async def run(
        self,
        stop: asyncio.Event,
        sock: socket.socket | None = None,
        on_ready: Callable[[str], Any] | None = None,
    ) -> None:
        """Follow the log and serve until `stop`."""
        sock = sock or self.bind()
        self.forwarder.ports = plane.Ports((self.url, *self.plane))
        await self.follower.load_snapshot()
        follow = self.follower.start()
        try:
            with contextlib.suppress(TimeoutError):
                await self.follower.caught_up(CATCH_UP_S)
            try:
                self.admission.check_owners(self.keys, self.follower.view.state)
            except GatewayError:
                sock.close()
                raise
            http = self.forwarder.open(self.connect_timeout_s, self.upstream_timeout_s)
            compiled = self.forwarder.readers  # the lean server's, too (`front.Front`)
            server = Serving(
                self.server, self.routes(), self.boundary, self.lines, self.idle_timeout_s, compiled
            )
            await server.prepare()
            if self.sharing is not None:
                await self.sharing.start()  # the others' shares known before a request
            await server.start(sock)
            answers = None
            if self.nc is not None:
                # Answered once the view has caught up: before, it would say of a replica
                # it has not folded yet that it routes nothing there, and then route there.
                answers = await self.nc.subscribe(
                    subjects.gateway_inflight_wildcard(self.root), cb=self.answers.answer
                )
                # Announced once serving: a reader that finds it may send it requests.
                if self.fleet is None:
                    self.fleet = Fleet(self.nc, self.root, me=pages.announcement(self))
                await self.fleet.start()
            log.info(
                "gateway: serving %s/v1 from the view at seq %d, routing by %s, on %s",
                *(self.url, self.follower.seq, self.rule, loop_name()),
            )
            if self.settle_heap:
                settle_heap()
            if on_ready is not None:
                on_ready(self.url)
            reporter = asyncio.create_task(
                self.uses.report(stop, self._recheck_owners), name="gateway: use"
            )
            try:
                stopper = asyncio.create_task(stop.wait())
                await asyncio.wait([stopper, follow], return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if follow.done() and not stop.is_set():
                    follow.result()  # raises what stopped it
                    raise GatewayError("the gateway's follower of the log stopped")
            finally:
                if self.fleet is not None:
                    # Goodbye first: nobody counts on it while it finishes what it has.
                    await self.fleet.stop()
                if self.sharing is not None:
                    await self.sharing.stop()
                if answers is not None:
                    with contextlib.suppress(nats.errors.Error):
                        await answers.unsubscribe()
                await server.stop()
                await http.close()
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
                await self.holding.stop()
                # What was served and not reported yet is reported on the way out.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2):
                        await self.uses.publish(force=True)
        finally:
            await self.follower.stop()

    def _recheck_owners(self) -> None:
        """The keys' owners against the quota tree now (`Admission.recheck_owners`)."""
        self.admission.recheck_owners(self.keys, self.follower.view.state)

    def traffic(self) -> tuple[dict[str, int], dict[str, int]]:
        """Requests per model since the start, and in flight now: what its announcements
        say, which a dashboard beside it sums (services.dashboard.traffic)."""
        return pages.traffic(self)

    # ------------------------------------------------------------------ handlers

    async def _health(self, request: Request) -> Whole:
        return pages.health(self)

    async def _models(self, request: Request) -> Whole:
        return pages.models(self, request)

    async def _metrics(self, request: Request) -> Whole:
        return Whole(self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def _proxy(self, request: Request) -> Awaitable[Answer]:
        """`_served`'s coroutine for `request` (returned, not awaited: a frame less)."""
        self.counts.requests += 1
        request[MODEL] = NOT_READ
        request[T0] = time.perf_counter()
        # One span a request (SERVER, a child of the client's traceparent), unless tracing
        # is off (OTEL_* variables): none is made then (`span_of`), nothing said to it.
        made = span_of(request, self.fast_path)
        if made is NO_SPAN:
            request[SPAN] = INVALID_SPAN
            return self._served(request, None)
        return self._spanned(request, made)

    async def _spanned(self, request: Request, made: Any) -> Answer:
        with made as span:
            request[SPAN] = span
            return await self._served(request, span)

    async def _served(self, request: Request, span: trace.Span | None) -> Answer:
        """`_proxy`'s request, answered and counted; `span`: its span, None when none is
        made (nothing is said to it)."""
        status = 499  # the client went away before an answer (nginx's number for it)
        refused: str | None = None
        try:
            resp = await self._route(request)
            status = request.get(STATUS, resp.status)
            return resp
        except Refusal as e:
            status = e.status
            refused = e.reason
            if span is not None:
                span.set_attribute("llmgw.reason", e.reason)
            raise
        finally:
            if held := request.get(HELD):
                self.budget.give(held)
            model = request[MODEL]
            if model != UNKNOWN:
                by_model = self.counts.by_model
                by_model[model] = by_model.get(model, 0) + 1
            key = request.get(KEY)
            owner = NO_OWNER if key is None else key.owner
            if span is not None:
                if key is not None:
                    span.set_attribute("llmgw.owner", owner)
                span.set_attribute("http.response.status_code", status)
                span.set_attribute("gen_ai.request.model", model)
            labelled, metrics = self.labelled, self.metrics
            if refused is not None:
                labelled.of(metrics.errors, model, refused).inc()
            # Kept children, looked up with no function made for it (`group_of`).
            k = ("served", model, status, owner)
            done = labelled.groups.get(k) or labelled.group_of(
                k, metrics_served, labelled, metrics, model, status, owner
            )
            done(time.perf_counter() - request[T0])

    async def _route(self, request: Request) -> Answer:
        key = authorize(self.keys, request)
        # Over its rpm, a key is refused before its body is read: now, or if the body came
        # whole with its head (most), by `admit` below (the rpm first) or as it is refused.
        checked = key is None or not request.content.is_eof()
        if key is not None:
            request[KEY] = key
            if checked:
                self.admission.early(request, key, self.clock())
        try:
            body = body_now(request, self.max_body, self.budget) or await read_body(
                request, self.max_body, self.budget, self.body_timeout_s
            )
            request[MODEL] = UNKNOWN  # read: until `_routed` names its model, none
            head = parse(body, self.reads_prompt)
        except Refusal:
            if key is not None and not checked:
                self.admission.early(request, key, self.clock())
            raise
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
            reserved = self.admission.admit(key, reserve, self.clock())
        except Refusal as e:
            if not checked and e.kind == "requests":  # its rpm, as if before its body
                request[MODEL] = NOT_READ
                raise
            # Refused for its tpm, the body read: counted under its model, which only
            # `_routed` would have named (worked out here for a refusal alone).
            m = self._scope.resolve(self.follower.view, head.model, key.owner)
            request[MODEL] = UNKNOWN if m is None else m.name
            raise
        try:
            return await self._routed(request, key, body, head)
        finally:
            if reserved or key.limits.tpm is not None:
                self.admission.settle(key, reserved, request.get(TOOK, 0), self.clock())

    async def _routed(self, request: Request, key: Key | None, body: bytes, head: Head) -> Answer:
        m = self._scope.declared(self.follower.view, head.model, None if key is None else key.owner)
        request[MODEL] = m.name
        route = route_of(request, m.name, head, body, key)
        request[ROUTE] = route
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
        if stream:
            body = self.continuations.plan(request, m, route, body)
        view = self.follower.view
        # Nobody overtakes a line: a new request joins it, even if a slot has just freed.
        r = (
            None
            if self.room.waiting(m.name)
            else self.router.pick(
                view, m, route, limit=routing.admit_limit(view, m, self.inflight_factor)
            )
        )
        request[PICKED_AT] = view.seq
        held: Stream | None = None
        if r is None:
            try:
                r, held = await self.holding.wait(request, m, route, stream, key)
            except Answered as a:
                return a.resp
        try:
            return await self._send(request, m, r, route, body, stream, strip, held)
        except Refusal as e:
            if held is None:
                raise
            # A held stream has had its 200: the refusal goes as the stream's one
            # event, in the error shape the openai package raises from.
            await sse_error(request, held, e)
            return held

    async def _send(
        self,
        request: Request,
        m: catalog.Model,
        first: Any,
        route: routing.Route,
        body: bytes,
        stream: bool,
        strip: bool,
        held: Stream | None,
    ) -> Answer:
        """Send the request to `first` (picked and counted in flight), and once more to
        another replica if it fails before its first byte."""
        tried: list[str] = []
        last: Unreachable | None = None
        made: trace.Span = request[SPAN]
        span = None if made is INVALID_SPAN else made  # None: none made, nothing said to it
        labelled, metrics = self.labelled, self.metrics
        k = ("sent", m.name)
        overhead, inflight = labelled.groups.get(k) or labelled.group_of(
            k, metrics_sent, labelled, metrics, m.name
        )
        r = first
        for attempt in range(2):
            if attempt:
                view = self.follower.view
                limit = routing.admit_limit(view, m, self.inflight_factor)
                r = self.router.pick(view, m, route, avoid=tried, limit=limit)
                if r is None:
                    break
                request[PICKED_AT] = self.follower.seq
                self.counts.retries += 1
                self.metrics.retries.inc()
                if span is not None:
                    span.set_attribute("llmgw.retry", True)
            if not attempt:
                overhead.observe(time.perf_counter() - request[T0])
            tried.append(r.id)
            if span is not None:
                span.set_attribute("llmgw.replica", r.id)
            self.routed.explain(request, route, span, r.id)
            inflight.inc()
            try:
                return await self.forwarder.forward(request, r, body, stream, strip, held)
            except Unreachable as e:
                again = "; trying another" if not attempt else ""
                self.lines.say(
                    logging.INFO, ("unreachable", r.id), "gateway: %s: %s%s", r.id, e, again
                )
                last = e
            finally:
                inflight.dec()
                if (holds := continuation.serving(request, r)) is not None:
                    self.holding.done(holds, route)
        raise no_replica(m.name, last)

    def _first_byte(self, request: Request, at: float | None = None) -> None:
        t = time.perf_counter() if at is None else at
        self.routed.first_byte(request, t)
        self.labelled.of(self.metrics.first_byte, request[MODEL]).observe(t - request[T0])
        woken = request.get(WOKEN)
        if woken is not None:
            self.counts.wakes.append(t - woken)
            self.metrics.wake.observe(t - woken)

    def _used(
        self,
        r: Any,
        tokens_in: int,
        tokens_out: int,
        request: Request,
        cached: int | None = None,
    ) -> None:
        """Count one request `request` that `r` answered, for its next `replica.used`,
        and what it took for its key's limit (settled as it ends); `cached` of its
        prompt tokens the engine said it served from its prefix cache."""
        request[TOOK] = tokens_in + tokens_out
        self.uses.used(r, tokens_in, tokens_out, request.get(KEY), cached)
        self.routed.ended(request, request[MODEL], r, tokens_in, cached)

    def _on_fold(self, seq: int, event: ev.Event, rejection: Any) -> None:
        """After each event the follower folds: the router forgets the replicas it took
        out of routing for good (one entry for every replica ever picked, in a gateway
        that runs for months, else), and the waiting room serves or refuses its lines."""
        if rejection is not None:
            return
        gone = routing.leaving(self.follower.view, event, self.router.kept())
        if gone:
            self.router.forget(gone)
            self.continuations.leaving(gone)
        self.holding.on_fold(event)


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:8322` for IPv6) -> (host, port); ValueError with a message."""
    return listen.parse(text, DEFAULT_LISTEN)
