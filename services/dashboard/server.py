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
address), or the cookie the page's first load sets.

It must not publish or write to the broker; its only file is the token it may generate.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
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
from starlette.types import ASGIApp, Receive, Scope, Send

from schemas import subjects
from services.core import preemption
from services.dashboard import health, hub, metrics, state
from services.dashboard.listen import DEFAULT_LISTEN
from services.replay import explain, history, rebuild
from services.replay.errors import ReplayError, UnknownEntity

log = logging.getLogger("llmgw.dashboard")

STATIC = Path(__file__).parent / "static"
TOKEN_FILE = "dashboard.token"
URL_FILE = "dashboard.url"
COOKIE = "llmgw_token"
# HEALTH_S is how often the log's health (projector lag, dead letters) is read.
HEALTH_S = 2.0
# PAST_VIEWS bounds the rebuilt past views kept: a slider dragged back and forth asks for
# the same few moments again.
PAST_VIEWS = 8


class DashboardError(Exception):
    """Why the dashboard cannot serve; str() is the one line to show."""


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:8321` for IPv6) -> (host, port); ValueError with a message."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{text!r} is not HOST:PORT (like {DEFAULT_LISTEN})")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
        return path.read_text().strip()
    data.mkdir(parents=True, exist_ok=True)
    made = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fp:
        fp.write(made + "\n")
    return made


class _TokenGate:
    """Every request shows the token, or gets 401; only GET and HEAD pass at all."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            await PlainTextResponse("read-only: only GET\n", 405)(scope, receive, send)
            return
        if self.token is not None:
            req = Request(scope)
            shown = (
                req.query_params.get("token")
                or req.cookies.get(COOKIE)
                or req.headers.get("authorization", "").removeprefix("Bearer ").strip()
            )
            if not shown or not hmac.compare_digest(shown.encode(), self.token.encode()):
                await PlainTextResponse("a token is needed: ?token=T\n", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
    policy: preemption.Config = field(default_factory=preemption.Config)
    """The policy `/api/plan` asks by default (its query may change the timings)."""
    url: str = ""
    """`http://host:port/` once bound."""
    health: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = metrics.Metrics(
            lambda: self.hub.view, lambda: self.health, lambda: len(self.hub.clients)
        )
        self.hub = hub.Hub(
            self.js,
            root=self.root,
            keep=self.keep,
            client_frames=self.client_frames,
            on_change=self.metrics.observe,
        )
        # _past keeps the views of past sequences by (listing, seq): a view of a log
        # listed before is not one of the log that replaced it.
        self._past: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self.app = _TokenGate(self._routes(), self.token)
        self._stop = asyncio.Event()

    def _routes(self) -> Starlette:
        r: list[Any] = [
            Route("/", self._index, methods=["GET"]),
            Route("/api/view", self._view, methods=["GET"]),
            Route("/api/events", self._events, methods=["GET"]),
            Route("/api/explain/{kind}/{name:path}", self._explain, methods=["GET"]),
            Route("/api/history/{kind}/{name:path}", self._history, methods=["GET"]),
            Route("/api/plan", self._plan, methods=["GET"]),
            Route("/api/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]
        return Starlette(routes=r)

    # ------------------------------------------------------------ lifecycle

    def bind(self) -> socket.socket:
        host, port = parse_listen(self.listen)
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(fam, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise DashboardError(f"cannot listen on {self.listen}: {e.strerror}") from e
        sock.listen(128)
        sock.setblocking(False)
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if fam == socket.AF_INET6 else host
        self.url = f"http://{shown}:{bound}/"
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
            sock.close()

    async def _check_health(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            got = await health.check(self.js, self.db_path, self.root)
            if got:
                self.health = got
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEALTH_S)

    # ------------------------------------------------------------ routes

    async def _index(self, req: Request) -> Response:
        resp = FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})
        shown = req.query_params.get("token")
        if self.token is not None and shown:
            resp.set_cookie(COOKIE, shown, httponly=True, samesite="strict")
        return resp

    async def _at(self, req: Request) -> Any:
        """The view the query names: `seq=N`, `at=T`, or the live one."""
        q = req.query_params
        if "seq" in q:
            try:
                seq = int(q["seq"])
            except ValueError:
                raise _BadRequest(f"seq: {q['seq']!r} is not a sequence number") from None
            if seq > self.hub.seq:
                # Past the head the view is still growing: never kept.
                return (await rebuild.from_stream(self.js, until_seq=seq, root=self.root)).view
            return await self._past_view(
                (self.hub.listings, seq),
                lambda: rebuild.from_stream(self.js, until_seq=seq, root=self.root),
            )
        if "at" in q:
            try:
                at = datetime.fromisoformat(q["at"].replace("Z", "+00:00"))
            except ValueError:
                raise _BadRequest(f"at: {q['at']!r} is not an RFC3339 time") from None
            if at.tzinfo is None:
                raise _BadRequest("at: give a time with its zone (2026-11-29T14:00:00Z)")
            return (await rebuild.from_stream(self.js, until_time=at, root=self.root)).view
        if self.hub.view is None:
            await asyncio.wait_for(self.hub.listed.wait(), 30)
        return self.hub.view

    async def _past_view(
        self, key: tuple[int, int], make: Callable[[], Awaitable[rebuild.Rebuilt]]
    ) -> Any:
        got = self._past.get(key)
        if got is None:
            got = (await make()).view
            self._past[key] = got
            if len(self._past) > PAST_VIEWS:
                self._past.popitem(last=False)
        return got

    async def _view(self, req: Request) -> Response:
        try:
            v = await self._at(req)
        except _BadRequest as e:
            return JSONResponse({"error": str(e)}, 400)
        doc = state.view_doc(v, everything=req.query_params.get("all") == "1", with_digest=True)
        doc["dead_letters"] = self.health.get("dead_letters", {})
        doc["head"] = self.hub.seq
        return JSONResponse(doc)

    async def _events(self, req: Request) -> Response:
        raw = req.query_params.get("from_seq") or ""
        last = req.headers.get("last-event-id", "")
        from_seq: int | None = None
        if last.isdigit():
            from_seq = int(last) + 1
        elif raw:
            if not raw.isdigit() or int(raw) < 1:
                return JSONResponse({"error": f"from_seq: {raw!r} is not a sequence >= 1"}, 400)
            from_seq = int(raw)
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

    async def _story(
        self, req: Request, kind: str, make: Callable[[str, str], Any], seq: int | None
    ) -> Any:
        w = make(kind, req.path_params["name"])
        got = await rebuild.from_stream(self.js, until_seq=seq, watcher=w, root=self.root)
        return w, got.view

    def _seq(self, req: Request) -> int | None:
        raw = req.query_params.get("seq")
        if raw is None:
            return None
        if not raw.isdigit():
            raise _BadRequest(f"seq: {raw!r} is not a sequence number")
        return int(raw)

    async def _explain(self, req: Request) -> Response:
        kind = req.path_params["kind"]
        if kind not in explain.KINDS:
            return JSONResponse({"error": f"explain: {kind!r} is not one of {explain.KINDS}"}, 404)
        try:
            w, v = await self._story(
                req, kind, lambda k, n: explain.Explainer(n, self.root, kind=k), self._seq(req)
            )
            story = w.story(v)
        except _BadRequest as e:
            return JSONResponse({"error": str(e)}, 400)
        except UnknownEntity as e:
            return JSONResponse({"error": str(e)}, 404)
        except ReplayError as e:
            return JSONResponse({"error": str(e)}, 409)
        return JSONResponse(_plain(story.to_json()))

    async def _history(self, req: Request) -> Response:
        kind = req.path_params["kind"]
        if kind not in history.KINDS:
            return JSONResponse({"error": f"history: {kind!r} is not one of {history.KINDS}"}, 404)
        try:
            tl, v = await self._story(
                req, kind, lambda k, n: history.Timeline(k, n, self.root), self._seq(req)
            )
            tl.resolve(_known(v, kind))
            tl.require()
        except _BadRequest as e:
            return JSONResponse({"error": str(e)}, 400)
        except UnknownEntity as e:
            return JSONResponse({"error": str(e)}, 404)
        except ReplayError as e:
            return JSONResponse({"error": str(e)}, 409)
        return JSONResponse(
            {"kind": kind, "name": tl.name, "entries": [e.to_json() for e in tl.entries]}
        )

    async def _plan(self, req: Request) -> Response:
        q = req.query_params
        model = q.get("model")
        if not model:
            return JSONResponse({"error": "plan: give ?model=M"}, 400)
        try:
            v = await self._at(req)
            cfg = _policy(self.policy, q)
        except _BadRequest as e:
            return JSONResponse({"error": str(e)}, 400)
        if v.catalog.resolve(model) is None:
            return JSONResponse({"error": f"unknown model {model!r}"}, 404)
        if v.state.time is None:
            return JSONResponse({"error": "the log holds no events"}, 409)
        d = preemption.plan(v, model, v.state.time, cfg)
        return JSONResponse(d.to_json())

    async def _health(self, req: Request) -> Response:
        return JSONResponse({**self.health, "head": self.hub.seq, "clients": len(self.hub.clients)})

    async def _metrics(self, req: Request) -> Response:
        return Response(self.metrics.render(), media_type=metrics.CONTENT_TYPE)


class _BadRequest(Exception):
    pass


def _known(v: Any, kind: str) -> set[str]:
    """The names of that kind the view has, for a prefix or a "did you mean"."""
    s = v.state
    if kind == "replica":
        return set(s.replicas)
    if kind == "node":
        return set(s.nodes)
    return set(s.models) | {r.model for r in s.replicas.values()}


def _policy(base: preemption.Config, q: Any) -> preemption.Config:
    """The policy with the timings a `/api/plan` query changes (`min_lifetime_s`, ...)."""
    import dataclasses

    changes: dict[str, Any] = {}
    for f in dataclasses.fields(base):
        if f.name in q:
            try:
                changes[f.name] = type(getattr(base, f.name))(q[f.name])
            except ValueError:
                raise _BadRequest(f"{f.name}: {q[f.name]!r} is not a number") from None
    return dataclasses.replace(base, **changes) if changes else base


def _plain(doc: Any) -> Any:
    """JSON-safe: times and other objects as strings."""
    import json

    return json.loads(json.dumps(doc, default=str))


class _Server(uvicorn.Server):
    """uvicorn inside a loop that is someone else's: the signals are `llmgw`'s to handle
    (`until_signalled`), not the web server's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield

    def install_signal_handlers(self) -> None:
        return None
