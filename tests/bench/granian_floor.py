"""The floor of a proxy on granian, for `bench_peers.py --floor-granian`: what a Rust HTTP
server for Python costs on this host, beside the floor of a Python proxy
(`floor_proxy.py`), llmgw's gateway and the Rust routers.

    python tests/bench/granian_floor.py UPSTREAM_HOST UPSTREAM_PORT PORT

Run by the Python of a venv of its own (`bench_peers.py` makes it: granian, uvloop and
httptools from the package registry). granian (its embedded server, RSGI, one Rust
runtime thread) takes the client's side: the connections, the request's parse, the
answer's framing and writes. The app, on uvloop in the same process, sends each request
on to the upstream over a keep-alive pool of raw connections (httptools reads the answer)
and passes the answer back: whole with `response_bytes`, a stream chunk by chunk with
`send_bytes`. Nothing the gateway does is done: no keys, limits, routing, metrics, use,
continuation, timeouts or bounds. (Not the gateway's lean client: its venv holds granian,
uvloop and httptools alone, not the project.) Not a server to run: it asks whether a Rust-backed server
would take the cost of the gateway's own server away (issue 42 lists it as a candidate),
measured as the floor of what any gateway on it would cost.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from typing import Any

import httptools
import uvloop
from granian.constants import Interfaces  # type: ignore[import-not-found, unused-ignore]
from granian.server.embed import Server  # type: ignore[import-not-found, unused-ignore]

# Past the ~200 streams the bench keeps open: granian's default holds a worker's requests
# at its backlog (128), which makes the streams past it wait for a slot.
BACKLOG = 2048


class _Upstream(asyncio.Protocol):
    """A keep-alive connection to the upstream: one request at a time, its answer's
    head as a future and its body as chunks."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.head: asyncio.Future[tuple[int, str, bool]] | None = None
        self.chunks: deque[bytes] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.ended = False
        self.ctype = ""
        self.chunked = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-type":
            self.ctype = value.decode("latin-1")
        elif n == b"transfer-encoding":
            self.chunked = True

    def on_headers_complete(self) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_result((self.parser.get_status_code(), self.ctype, self.chunked))

    def on_body(self, data: bytes) -> None:
        self.chunks.append(data)
        self._wake()

    def on_message_complete(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def send(self, request: bytes) -> asyncio.Future[tuple[int, str, bool]]:
        assert self.transport is not None
        self.head = asyncio.get_running_loop().create_future()
        self.chunks.clear()
        self.ended = False
        self.ctype = ""
        self.chunked = False
        self.transport.write(request)
        return self.head

    async def next(self) -> bytes | None:
        """What came of the body since the last call; None at its end."""
        while not self.chunks:
            if self.ended:
                return None
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        if len(self.chunks) == 1:
            return self.chunks.popleft()
        data = b"".join(self.chunks)
        self.chunks.clear()
        return data


def app_for(host: str, port: int) -> Any:
    """The RSGI app passing each request on to `host:port`."""
    idle: list[_Upstream] = []
    hostline = f"Host: {host}:{port}\r\n".encode()

    async def connection() -> _Upstream:
        if idle:
            return idle.pop()
        _, up = await asyncio.get_running_loop().create_connection(_Upstream, host, port)
        return up

    async def app(scope: Any, proto: Any) -> None:
        body = await proto()
        up = await connection()
        status, ctype, chunked = await up.send(
            b"POST %b HTTP/1.1\r\n%bContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (scope.path.encode(), hostline, len(body), body)
        )
        headers = [("content-type", ctype)]
        if chunked:
            out = proto.response_stream(status, headers)
            while (data := await up.next()) is not None:
                await out.send_bytes(data)
        else:
            parts = []
            while (data := await up.next()) is not None:
                parts.append(data)
            proto.response_bytes(status, headers, b"".join(parts))
        idle.append(up)

    return app


async def _serve(host: str, port: int, listen: int) -> None:
    server = Server(
        app_for(host, port),
        address="127.0.0.1",
        port=listen,
        interface=Interfaces.RSGI,
        runtime_threads=1,
        backlog=BACKLOG,
        backpressure=BACKLOG,
        log_enabled=False,
    )
    await server.serve()


def main() -> None:
    host, port, listen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    uvloop.run(_serve(host, port, listen))


if __name__ == "__main__":
    main()
