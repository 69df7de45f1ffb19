"""Benchmark: what the HTTP server stack alone costs a request, the gateway's handlers
left out: the same small JSON POST answered by aiohttp's `web.Application` (the
gateway's server before `--server lean`), aiohttp's low-level `web.Server`, the lean
server (`services.gateway.front.Front`) and a bare `asyncio.Protocol` with httptools
(the floor), each in a process of its own on uvloop. CPU per 1,000 requests of the
server's process and req/s, 16 clients on keep-alive connections, the kinds in turn,
`--rounds` times.

Run from the repository root:

    python tests/bench/bench_server_stack.py [--rounds 2] [--seconds 4]

Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("aiohttp-app", "aiohttp-server", "lean", "raw")
ANSWER = b'{"id":"x","object":"chat.completion","choices":[]}'
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


async def _serve(kind: str, sock: socket.socket) -> None:
    from aiohttp import web

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        return web.Response(body=ANSWER, content_type="application/json")

    loop = asyncio.get_running_loop()
    if kind == "aiohttp-app":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
    elif kind == "aiohttp-server":
        await loop.create_server(web.Server(handler, access_log=None), sock=sock)
    elif kind == "lean":
        import logging

        from services.gateway.exchange import Whole
        from services.gateway.front import Front, Request
        from services.gateway.guard import Lines

        headers = {"Content-Type": "application/json"}

        async def lean(request: Request) -> Whole:
            while await request.content.readany():
                pass
            return Whole(ANSWER, 200, headers)

        await Front(lean, Lines(logging.getLogger("bench")), 75.0).start(sock)
    else:
        import httptools

        tasks: set[asyncio.Task[None]] = set()

        class Raw(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                self.transport = transport
                self.parser = httptools.HttpRequestParser(self)

            def data_received(self, data: bytes) -> None:
                self.parser.feed_data(data)

            def on_message_complete(self) -> None:
                # A task a request, as each server makes one.
                task = loop.create_task(self.answer())
                tasks.add(task)
                task.add_done_callback(tasks.discard)

            async def answer(self) -> None:
                self.transport.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)
                )

        await loop.create_server(Raw, sock=sock)
    await asyncio.Event().wait()


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(port: int, seconds: float, pid: int) -> tuple[float, float]:
    """CPU s per 1,000 requests of `pid`, and req/s, over `seconds` of 16 clients."""
    done = [0]
    stop = asyncio.Event()

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while not stop.is_set():
            writer.write(REQUEST)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            done[0] += 1
        writer.close()

    clients = [asyncio.create_task(client()) for _ in range(16)]
    await asyncio.sleep(0.5)  # connections open, caches warm
    c0, n0, t0 = _cpu(pid), done[0], time.monotonic()
    await asyncio.sleep(seconds)
    c1, n1, t1 = _cpu(pid), done[0], time.monotonic()
    stop.set()
    await asyncio.gather(*clients)
    return (c1 - c0) / (n1 - n0) * 1000, (n1 - n0) / (t1 - t0)


async def _bench(rounds: int, seconds: float) -> None:
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    for _ in range(rounds):
        for kind in KINDS:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            proc = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--serve", kind, "--port", str(port), cwd=ROOT
            )
            try:
                for _ in range(100):
                    try:
                        _, w = await asyncio.open_connection("127.0.0.1", port)
                        w.close()
                        break
                    except OSError:
                        await asyncio.sleep(0.05)
                got[kind].append(await _load(port, seconds, proc.pid))
            finally:
                proc.terminate()
                await proc.wait()
    print(f"load average {os.getloadavg()[0]:.1f}; 16 clients, keep-alive, uvloop")
    for kind, runs in got.items():
        said = ", ".join(f"{cpu:.3f} s ({rate:,.0f} req/s)" for cpu, rate in runs)
        print(f"{kind:15} CPU per 1,000 requests: {said}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    import uvloop

    if args.serve:
        sys.path.insert(0, str(ROOT))
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", args.port))
        sock.listen(1024)
        uvloop.run(_serve(args.serve, sock))
        return
    uvloop.run(_bench(args.rounds, args.seconds))


if __name__ == "__main__":
    main()
