"""The HTTP server a gateway's routes are served by (`--server`): the lean one
(`services.gateway.front`, the default) or aiohttp's, the reference it is tested
against. Both serve the same handlers (`services.gateway.exchange`), refuse the same way
(`services.gateway.refusal`) and cancel a handler whose client is gone."""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.gateway import guard
from services.gateway.exchange import Answer, Request, as_aiohttp
from services.gateway.front import Front
from services.gateway.refusal import BOUNDARY, Routes, dispatch, openai_errors

log = logging.getLogger("llmgw.gateway")

# SHUTDOWN_S bounds a server's stop: what is still answered then is cut.
SHUTDOWN_S = 2.0


class Serving:
    """`routes` served on a socket by the server `kind` names (`lean` or `aiohttp`):
    `prepare` before the socket is served, `start` on it, `stop` at the end."""

    def __init__(
        self,
        kind: str,
        routes: Routes,
        boundary: guard.Boundary,
        lines: guard.Lines,
        idle_timeout_s: float,
        compiled: Any = None,
    ) -> None:
        self.kind, self.routes, self.boundary = kind, routes, boundary
        self.lines, self.idle_timeout_s = lines, idle_timeout_s
        self.compiled = compiled
        """The compiled relay's module for the lean server (`front.Front`), or None."""
        self.front: Front | None = None
        self.runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        """The routes as aiohttp's server serves them (`--server aiohttp`)."""
        app = web.Application(middlewares=[openai_errors])
        app[BOUNDARY] = self.boundary
        for path, methods in self.routes.items():
            for method, handler in methods.items():
                if method == "GET":  # and HEAD, as aiohttp's `add_get` has it
                    app.router.add_get(path, _on_aiohttp(handler))
                else:
                    app.router.add_route(method, path, _on_aiohttp(handler))
        return app

    async def prepare(self) -> None:
        if self.kind == "lean":
            # `dispatch` itself, its routes and edge bound: no coroutine of its own around
            # it, which each chunk of a stream would pass through on its way down.
            handle = functools.partial(dispatch, routes=self.routes, boundary=self.boundary)
            self.front = Front(
                handle,
                self.lines,
                self.idle_timeout_s,
                shutdown_timeout_s=SHUTDOWN_S,
                compiled=self.compiled,
            )
            return
        self.runner = web.AppRunner(
            self.app(),
            access_log=None,
            logger=guard.ParserLog(self.lines, log),
            handler_cancellation=True,
            shutdown_timeout=SHUTDOWN_S,
            keepalive_timeout=self.idle_timeout_s,
        )
        await self.runner.setup()

    async def start(self, sock: socket.socket) -> None:
        if self.front is not None:
            await self.front.start(sock)
        elif self.runner is not None:
            await web.SockSite(self.runner, sock).start()

    async def stop(self) -> None:
        if self.front is not None:
            await self.front.stop()
        if self.runner is not None:
            await self.runner.cleanup()


def _on_aiohttp(
    handler: Callable[[Request], Awaitable[Answer]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """`handler` as aiohttp's server calls it: its whole answer made aiohttp's."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return as_aiohttp(await handler(request))

    return handle
