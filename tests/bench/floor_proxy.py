"""The floor of a Python HTTP proxy, for `bench_peers.py --floor`: what Python's I/O
costs alone on this host, beside llmgw's gateway and the Rust routers.

    python tests/bench/floor_proxy.py UPSTREAM_HOST UPSTREAM_PORT PORT [hop]

uvloop and httptools, as the gateway's lean server and client: each client connection
gets a connection of its own to the upstream, each request is sent on with its body, and
the upstream's answer is passed back as its bytes come, in the read's callback (no
coroutine, no parse of the answer but where it ends, no re-chunking). Nothing the
gateway does is done: no keys, limits, routing, metrics, use, continuation, timeouts or
bounds. Not a server to run: a measure of how far below the routers Python's own cost
lies, so what is left between the gateway and them is the gateway's own work. With
`hop`, each client connection's answer bytes go through a coroutine of its own instead
(the read's callback sets a future the coroutine waits on; it writes what came): what a
chunk's wake of a waiting coroutine costs, as the gateway's request wakes for each chunk.
"""

from __future__ import annotations

import asyncio
import sys

import httptools
import uvloop


class _Upstream(asyncio.Protocol):
    def __init__(self, client: _Client, hop: bool) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.came: list[bytes] = []
        self.waiter: asyncio.Future[None] | None = None
        self.pump: asyncio.Task[None] | None = None
        if hop:
            self.pump = asyncio.get_running_loop().create_task(self._pump())

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.pump is None:
            if self.client.transport is not None:
                self.client.transport.write(data)
            return
        self.came.append(data)
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.came:
                self.waiter = loop.create_future()
                await self.waiter
            data = b"".join(self.came)
            self.came.clear()
            if self.client.transport is not None:
                self.client.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.pump is not None:
            self.pump.cancel()
        if self.client.transport is not None:
            self.client.transport.close()


class _Client(asyncio.Protocol):
    def __init__(self, host: str, port: int, hop: bool) -> None:
        self.host, self.port, self.hop = host, port, hop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.upstream: _Upstream | None = None
        self.pending: list[bytes] = []
        self.url = b""
        self.body: list[bytes] = []
        self.connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        loop = asyncio.get_running_loop()
        self.connecting = loop.create_task(self._connect(loop))

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> None:
        _, up = await loop.create_connection(
            lambda: _Upstream(self, self.hop), self.host, self.port
        )
        self.upstream = up
        if self.pending and up.transport is not None:
            up.transport.write(b"".join(self.pending))
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        self.body.clear()
        request = (
            b"POST %b HTTP/1.1\r\nHost: %b:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b"
            % (self.url, self.host.encode(), self.port, len(body), body)
        )
        up = self.upstream
        if up is None or up.transport is None:
            self.pending.append(request)
        else:
            up.transport.write(request)


async def _serve(host: str, port: int, listen: int, hop: bool) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(host, port, hop), "127.0.0.1", listen)
    await server.serve_forever()


def main() -> None:
    host, port, listen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    uvloop.run(_serve(host, port, listen, sys.argv[4:] == ["hop"]))


if __name__ == "__main__":
    main()
