"""The dashboard's HTTP server: the page, the list-and-watch API, and `/metrics`.

Called by `llmgw dashboard` and by `llmgw up` (`Dashboard(...).run(stop)`), and by tests.
Routes, all GET (anything else is 405: nothing here changes the cluster):
- `/` and `/static/...`: one page, plain JavaScript modules and CSS, no build step;
- `/api/view[?seq=N|at=T]`: the whole view, live or rebuilt as it stood then;
- `/api/events[?from_seq=N]`: Server-Sent Events, list then watch (`hub`);
- `/api/explain/{replica|model|node}/NAME`, `/api/history/{kind}/NAME`, `/api/plan?model=M`;
- `/api/health`: the log's last sequence, the projector's lag, dead letters, clients;
- `/metrics`: Prometheus.
With a token every route asks for it: `Authorization: Bearer T`, `?token=T` (the page's
address), or the cookie the page's first load sets. Every route answers only for a
`Host` it serves (421 otherwise: DNS rebinding gets nothing) and only to its own origin
(a cross-origin request is 403; no CORS header is ever sent); every query is parsed
strictly (`query`: 400 with one line, never a 500). Whatever folds the log again runs
on a worker thread, bounded and kept (`replays`).

It must not publish or write to the broker; its only file is the token it may generate.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from schemas import subjects
from services import listen
from services.bus.errors import BrokerUnavailable
from services.clock import utc_now
from services.core.policy import Config as PolicyConfig
from services.dashboard import health, hub, metrics, query, replays, state, traffic
from services.dashboard.errors import BadRequest, Busy, DashboardError, Unlisted
from services.dashboard.listen import DEFAULT_LISTEN
from services.hosts import Hosts, cross_origin, host_of, is_loopback, parse_hosts
from services.replay import explain, history

log = logging.getLogger("llmgw.dashboard")

STATIC = Path(__file__).parent / "static"
TOKEN_FILE = "dashboard.token"
URL_FILE = "dashboard.url"
COOKIE = "llmgw_token"
# BEATS_MAX bounds the nodes whose heartbeats are remembered for /metrics.
BEATS_MAX = 10_000

# HEALTH_S is how often the log's health (projector lag, dead letters) is read.
HEALTH_S = 2.0
# DEAD_WINDOW_S is the window over which dead letters are said to be growing (the
# shipped alert's `increase(...[5m])`): the page's banner names the consumers whose dead
# letters rose within it.
DEAD_WINDOW_S = 300.0
# NO_BROKER is the plane's health while the broker does not answer.
NO_BROKER: dict[str, Any] = {
    "running": False,
    "problems": ["the broker does not answer (or holds no log)"],
    "leaders": None,
    "projector": None,
}
# LISTED_S bounds how long a request for the live view waits for the first listing.
LISTED_S = 30.0

__all__ = [
    "BadRequest",
    "Dashboard",
    "DashboardError",
    "Hosts",
    "cross_origin",
    "host_of",
    "is_loopback",
    "parse_hosts",
]


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:8321` for IPv6) -> (host, port); ValueError with a message."""
    return listen.parse(text, DEFAULT_LISTEN)


def token_for(host: str, given: str | None, data: Path | None) -> str | None:
    """The token the dashboard asks for: the one given; else, off loopback, the one kept
    in the data directory (made once, mode 0600); else none."""
    if given:
        return given
    if is_loopback(host):
        return None
    if data is None:
        raise DashboardError(
            f"listening on {host} needs a token: pass --token, or a data directory to keep one"
        )
    path = data / TOKEN_FILE
    if path.exists():
        kept = path.read_text().strip()
        if not kept or kept.lower().startswith("change-me"):
            raise DashboardError(
                f"{path}: the token is empty or a placeholder (change-me-...), known to anyone "
                "who read the examples: put a random one there, or remove it to have one made"
            )
        return kept
    data.mkdir(parents=True, exist_ok=True)
    made = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fp:
        fp.write(made + "\n")
    return made


# SAME_ORIGIN are the headers every answer carries: no other origin may embed or read
# it, and no browser may guess its type.
SAME_ORIGIN = [
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"x-content-type-options", b"nosniff"),
    (b"content-security-policy", b"frame-ancestors 'none'"),
]


class _Gate:
    """Every request: only GET and HEAD (405); a `Host` this dashboard answers for
    (421); from its own origin (403); with the token, when there is one (401)."""

    def __init__(self, app: ASGIApp, token: str | None, hosts: Hosts) -> None:
        self.app = app
        self.token = token
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def same_origin(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SAME_ORIGIN]
            await send(message)

        if scope["method"] not in ("GET", "HEAD"):
            await PlainTextResponse("read-only: only GET\n", 405)(scope, receive, same_origin)
            return
        req = Request(scope)
        host = req.headers.get("host", "")
        if not self.hosts.allows(host):
            await PlainTextResponse(
                f"this dashboard does not answer for host {host[:100]!r} "
                "(--allow-host NAME serves a name)\n",
                421,
            )(scope, receive, same_origin)
            return
        why = cross_origin(req.headers, scope["path"])
        if why is not None:
            await PlainTextResponse(f"cross-origin requests are refused: {why}\n", 403)(
                scope, receive, same_origin
            )
            return
        if self.token is not None:
            shown = (
                req.query_params.get("token")
                or req.cookies.get(COOKIE)
                or req.headers.get("authorization", "").removeprefix("Bearer ").strip()
            )
            if not shown or not hmac.compare_digest(shown.encode(), self.token.encode()):
                await PlainTextResponse("a token is needed: ?token=T\n", 401)(
                    scope, receive, same_origin
                )
                return
        await self.app(scope, receive, same_origin)


@dataclass
class Dashboard:
    """The server: one hub, the HTTP app, and the uvicorn that serves it."""

    js: Any
    listen: str = DEFAULT_LISTEN
    root: str = subjects.DEFAULT_ROOT
    token: str | None = None
    db_path: Path | None = None
    """The projector's SQLite view, for its lag; None: unknown."""
    keep: int = hub.KEEP
    client_frames: int = hub.CLIENT_FRAMES
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The policy `/api/plan` asks by default (its query may change the timings), run by
    the plain engine whatever this one names (`what_if`) unless the query's `engine`
    names another."""
    url: str = ""
    """`http://host:port/` once bound."""
    health: dict[str, Any] = field(default_factory=dict)
    allow_hosts: tuple[str, ...] = ()
    """`Host` names served besides loopback ones (`--allow-host`, `Hosts`)."""
    nc: Any = None
    """The connection to listen for nodes' heartbeats on (core NATS, not in the log), for
    their age in /metrics; None: not listened for."""
    gateway: Callable[[], tuple[dict[str, int], dict[str, int]]] | None = None
    """The gateways of the same `llmgw up`: their requests per model since they started
    and their requests in flight per model (`services.bus.fleet.Traffic.counts`,
    from their announcements); None: requests a
    second come from the log's `replica.used` reports alone, in flight is unknown."""
    held: Callable[[], dict[str, int]] | None = None
    """Their waiting rooms: the requests they hold per model now
    (`services.bus.fleet.Traffic.held`); None: unknown."""

    def __post_init__(self) -> None:
        self.beats: dict[str, datetime] = {}
        """Per node, the time stamp of the last heartbeat heard (at most BEATS_MAX)."""
        # Answers for past moments are kept by what they name and the listing they are
        # of: a view of a log listed before is not one of the log that replaced it.
        self.replays = replays.Replays(self.js)
        self.metrics = metrics.Metrics(
            lambda: self.hub.view,
            lambda: self.health,
            lambda: len(self.hub.clients),
            lambda: self.replays,
            lambda: self.beats,
        )
        self.traffic = traffic.Traffic()
        self.hub = hub.Hub(
            self.js,
            root=self.root,
            keep=self.keep,
            client_frames=self.client_frames,
            on_change=self._observe,
            traffic=self._traffic_doc,
        )
        host, _ = parse_listen(self.listen)
        hosts = Hosts(is_loopback(host), frozenset(parse_hosts(self.allow_hosts)))
        self.app = _Gate(self._routes(), self.token, hosts)
        self._stop = asyncio.Event()

    def _observe(self, seq: int, ch: Any) -> None:
        self.metrics.observe(seq, ch)
        self.traffic.observe(ch)

    def _traffic_doc(self) -> dict[str, Any]:
        """Requests a second and in flight per model now (services.dashboard.traffic)."""
        if self.gateway is not None:
            requests, inflight = self.gateway()
            held = self.held() if self.held is not None else None
            self.traffic.sample(time.monotonic(), requests, inflight, held)
        return self.traffic.doc(utc_now())

    def _routes(self) -> Starlette:
        r: list[Any] = [
            Route("/", self._index, methods=["GET"]),
            Route("/api/view", self._view, methods=["GET"]),
            Route("/api/events", self._events, methods=["GET"]),
            Route("/api/explain/{kind}/{name:path}", self._explain, methods=["GET"]),
            Route("/api/history/{kind}/{name:path}", self._history, methods=["GET"]),
            Route("/api/plan", self._plan, methods=["GET"]),
            Route("/api/health", self._health, methods=["GET"]),
            Route("/api/traffic", self._traffic, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]
        return Starlette(routes=r)

    # ------------------------------------------------------------ lifecycle

    def bind(self) -> socket.socket:
        sock, url = listen.bind(self.listen, DEFAULT_LISTEN, 128, DashboardError)
        self.url = url + "/"
        return sock

    async def run(
        self,
        stop: asyncio.Event,
        sock: socket.socket | None = None,
        on_ready: Callable[[str], Any] | None = None,
    ) -> None:
        """Serve until `stop`: the hub's subscription, the health check, and HTTP."""
        sock = sock or self.bind()
        server = _Server(
            uvicorn.Config(
                self.app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=2,
            )
        )
        tasks = [
            asyncio.create_task(self.hub.run(stop), name="dashboard: hub"),
            asyncio.create_task(self._check_health(stop), name="dashboard: health"),
            asyncio.create_task(server.serve(sockets=[sock]), name="dashboard: http"),
        ]
        beats = await self._listen_beats()
        try:
            if on_ready is not None:
                on_ready(self.url)
            done, _ = await asyncio.wait(
                [asyncio.create_task(stop.wait()), *tasks], return_when=asyncio.FIRST_COMPLETED
            )
            for t in done:
                if t in tasks and t.exception() is not None:
                    raise DashboardError(
                        f"the dashboard failed: {t.exception()}"
                    ) from t.exception()
        finally:
            stop.set()
            for c in list(self.hub.clients):
                c.end("the dashboard is stopping")
            server.should_exit = True
            await asyncio.wait(tasks, timeout=10)
            for t in tasks:
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)
            await self.replays.close()
            if beats is not None:
                with contextlib.suppress(Exception):
                    await beats.unsubscribe()
            sock.close()

    async def _listen_beats(self) -> Any:
        """Subscribe to the nodes' heartbeats, keeping each node's last time stamp; the
        subscription, or None without a connection (or when the broker refuses it)."""
        if self.nc is None:
            return None

        async def on(msg: Any) -> None:
            with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                body = json.loads(msg.data)
                node, t = str(body["node"]), datetime.fromisoformat(body["time"])
                if t.tzinfo is None or node != subjects.node_of_heartbeat(msg.subject):
                    return
                # Bounded: a flood of invented names cannot grow it past BEATS_MAX.
                if node in self.beats or len(self.beats) < BEATS_MAX:
                    self.beats[node] = t

        try:
            return await self.nc.subscribe(f"{self.root}.heartbeat.*", cb=on)
        except Exception as e:
            log.warning("dashboard: not listening for heartbeats: %s", e)
            return None

    async def _check_health(self, stop: asyncio.Event) -> None:
        seen: deque[tuple[float, dict[str, int]]] = deque()
        while not stop.is_set():
            got = await health.check(self.js, self.db_path, self.root)
            if got:
                got["dead_letters_new"] = health.growth(
                    seen, time.monotonic(), got.get("dead_letters", {}), DEAD_WINDOW_S
                )
                got["dead_letters_window_s"] = DEAD_WINDOW_S
                self.health = got
            else:
                # A broker that does not answer is a plane not running, whatever it said
                # when it last did; the rest of the last check stays, as it was then.
                self.health = {**self.health, "plane": NO_BROKER}
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEALTH_S)

    # ------------------------------------------------------------ routes

    async def _index(self, req: Request) -> Response:
        try:
            query.take(req.query_params.multi_items(), query.NONE)
        except BadRequest as e:
            return _bad(e)
        resp = FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})
        shown = req.query_params.get("token")
        if self.token is not None and shown:
            resp.set_cookie(COOKIE, shown, httponly=True, samesite="strict")
        return resp

    async def _traffic(self, req: Request) -> Response:
        """Per model: requests a second, in flight (null: unknown) and where that came
        from (`gateway`: one in this process; `log`: its `replica.used` reports)."""
        try:
            query.take(req.query_params.multi_items(), query.NONE)
        except BadRequest as e:
            return _bad(e)
        return JSONResponse({"models": self._traffic_doc()})

    async def _live(self) -> Any:
        """The live view; `Unlisted` while the hub has not listed the log yet."""
        if self.hub.view is None:
            try:
                await asyncio.wait_for(self.hub.listed.wait(), LISTED_S)
            except TimeoutError:
                raise Unlisted from None
        return self.hub.view

    def _live_fields(self) -> dict[str, Any]:
        """What a view document says of the log now, whichever moment it shows."""
        return {"dead_letters": self.health.get("dead_letters", {}), "head": self.hub.seq}

    def _moment_key(self, what: str, m: query.Moment, *more: Hashable) -> Hashable | None:
        """What an answer about moment `m` is kept by; None past the head, where the
        view is still growing."""
        if m.seq is not None and m.seq > self.hub.seq:
            return None
        return (self.hub.listings, what, m.seq, m.at, *more)

    async def _at(
        self,
        what: str,
        m: query.Moment | None,
        now: Callable[[Any], Response],
        then: Callable[[Any, query.Moment], Coroutine[Any, Any, replays.Answer]],
        *more: Hashable,
    ) -> Response:
        """`what` (a route) at the moment `m`: `now` on the live view when no moment is
        asked for (503 while the hub has not listed the log), else the replay
        `then(js, m)`, kept by the moment and `more` (the route's arguments)."""
        if m is None:
            try:
                v = await self._live()
            except Unlisted:
                return _unavailable(Unlisted.WHY, replays.RETRY_AFTER_S)
            return now(v)
        return await self._replay(self._moment_key(what, m, *more), lambda js: then(js, m))

    async def _replay(self, key: Hashable | None, work: replays.Work) -> Response:
        """The answer of a replay, or 503 with Retry-After when too many run."""
        try:
            got = await self.replays.answer(key, work)
        except Busy as e:
            return _unavailable(str(e), e.retry_after_s)
        except BrokerUnavailable as e:
            return _unavailable(f"the broker does not answer: {e}", replays.RETRY_AFTER_S)
        except TimeoutError:
            return _unavailable(
                f"the replay did not end within {replays.REPLAY_S:.0f} s (the broker does "
                "not answer?)",
                replays.RETRY_AFTER_S,
            )
        return Response(got.body, got.status, media_type="application/json")

    async def _view(self, req: Request) -> Response:
        try:
            q = query.take(req.query_params.multi_items(), query.VIEW)
            m = query.moment(q)
            everything = query.switch(q, "all")
        except BadRequest as e:
            return _bad(e)

        def now(v: Any) -> Response:
            doc = state.view_doc(v, everything=everything, with_digest=True)
            return JSONResponse({**doc, **self._live_fields()})

        resp = await self._at(
            "view", m, now, lambda js, at: replays.view(js, at, everything, self.root), everything
        )
        if m is not None and resp.status_code == 200:
            # The kept document is of the past; what it says of the log now is added.
            extra = replays.dumps(self._live_fields())
            resp.body = bytes(resp.body[:-1]) + b"," + extra[1:]
            resp.init_headers()
        return resp

    async def _events(self, req: Request) -> Response:
        try:
            q = query.take(req.query_params.multi_items(), query.EVENTS)
            from_seq: int | None = None
            last = req.headers.get("last-event-id")
            if last:
                from_seq = query.sequence("Last-Event-ID", last) + 1
            elif "from_seq" in q:
                from_seq = query.sequence("from_seq", q["from_seq"], least=1)
        except BadRequest as e:
            return _bad(e)
        if self.hub.view is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.hub.listed.wait(), 30)
        client = self.hub.attach(from_seq)
        return StreamingResponse(
            self._stream(client),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def _stream(self, client: hub.Client) -> AsyncIterator[bytes]:
        try:
            yield b"retry: 1000\n\n"
            while True:
                got = await client.take(hub.PING_S)
                if got is None:
                    yield hub.frame("relist", {"reason": client.gone})
                    return
                yield got or b": ping\n\n"
        finally:
            self.hub.detach(client)

    async def _story(self, req: Request, what: str, kinds: tuple[str, ...]) -> Response:
        """`explain` or `history` of the entity the path names, up to `?seq=N`."""
        kind = req.path_params["kind"]
        if kind not in kinds:
            return JSONResponse({"error": f"{what}: {kind!r} is not one of {kinds}"}, 404)
        try:
            q = query.take(req.query_params.multi_items(), query.STORY)
            seq = query.sequence("seq", q["seq"]) if "seq" in q else None
            name = query.entity(kind, req.path_params["name"])
        except BadRequest as e:
            return _bad(e)
        key = (
            None
            if seq is None or seq > self.hub.seq
            else (self.hub.listings, what, kind, name, seq)
        )
        # Live, ages are counted from now (the log's last event may be long past); at a
        # past moment, from that moment.
        now = utc_now() if seq is None else None
        return await self._replay(
            key, lambda js: replays.story(js, what, kind, name, seq, self.root, now)
        )

    async def _explain(self, req: Request) -> Response:
        return await self._story(req, "explain", explain.KINDS)

    async def _history(self, req: Request) -> Response:
        return await self._story(req, "history", history.KINDS)

    def what_if(self) -> PolicyConfig:
        """The settings `/api/plan` starts from: the dashboard's policy, with the plain
        engine, the spec (a reader's default, as `llmgw preemption plan`'s; every engine
        decides the same)."""
        return dataclasses.replace(self.policy, engine="plain")

    async def _plan(self, req: Request) -> Response:
        try:
            q = query.take(req.query_params.multi_items(), query.PLAN)
            if not q.get("model"):
                raise BadRequest("model: give ?model=M, the model to plan for")
            model = query.entity("model", q["model"])
            m = query.moment(q)
            cfg = query.policy(self.what_if(), q)
        except BadRequest as e:
            return _bad(e)

        def now(v: Any) -> Response:
            status, doc = replays.plan_of(v, model, cfg)
            return JSONResponse(doc, status)

        return await self._at(
            "plan", m, now, lambda js, at: replays.plan(js, at, model, cfg, self.root), model, cfg
        )

    async def _health(self, req: Request) -> Response:
        try:
            query.take(req.query_params.multi_items(), query.NONE)
        except BadRequest as e:
            return _bad(e)
        return JSONResponse({**self.health, "head": self.hub.seq, "clients": len(self.hub.clients)})

    async def _metrics(self, req: Request) -> Response:
        try:
            query.take(req.query_params.multi_items(), query.NONE)
        except BadRequest as e:
            return _bad(e)
        return Response(self.metrics.render(), media_type=metrics.CONTENT_TYPE)


def _bad(e: BadRequest) -> Response:
    return JSONResponse({"error": str(e)}, 400)


def _unavailable(why: str, retry_after_s: int) -> Response:
    return JSONResponse({"error": why}, 503, headers={"Retry-After": str(retry_after_s)})


class _Server(uvicorn.Server):
    """uvicorn inside a loop that is someone else's: the signals are `llmgw`'s to handle
    (`until_signalled`), not the web server's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield

    def install_signal_handlers(self) -> None:
        return None
