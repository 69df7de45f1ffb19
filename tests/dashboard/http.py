"""A small HTTP/1.1 client for the dashboard's tests and benchmark: plain GETs, and a
Server-Sent Events reader, on asyncio sockets (no client library to bring in)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def _open(url: str, headers: dict[str, str] | None, method: str = "GET") -> Any:
    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    path = u.path + (f"?{u.query}" if u.query else "")
    given = dict(headers or {})
    # A `Host` given replaces the URL's (a test of which hosts the server answers for).
    head = f"{method} {path} HTTP/1.1\r\nHost: {given.pop('Host', u.netloc)}\r\n"
    for k, v in given.items():
        head += f"{k}: {v}\r\n"
    writer.write((head + "\r\n").encode())
    await writer.drain()
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    got: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        got[k.strip().lower()] = v.strip()
    return reader, writer, status, got


async def get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> Reply:
    reader, writer, status, got = await _open(url, headers, method)
    try:
        if got.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size = int((await reader.readline()).strip(), 16)
                if size == 0:
                    break
                body += await reader.readexactly(size)
                await reader.readline()
        elif "content-length" in got:
            body = await reader.readexactly(int(got["content-length"]))
        else:
            body = await reader.read()
        return Reply(status, got, body)
    finally:
        writer.close()


@dataclass
class Frame:
    event: str
    data: Any
    id: int | None


class Events:
    """An open `/api/events` stream: `await next()` gives each frame (comments skipped)."""

    def __init__(self, reader: Any, writer: Any, status: int, headers: dict[str, str]) -> None:
        self.reader, self.writer, self.status, self.headers = reader, writer, status, headers
        self._buf = b""

    @classmethod
    async def open(cls, url: str, headers: dict[str, str] | None = None) -> Events:
        return cls(*(await _open(url, headers)))

    async def _chunk(self) -> bytes:
        size_line = await self.reader.readline()
        if not size_line:
            raise EOFError("the stream ended")
        size = int(size_line.strip(), 16)
        if size == 0:
            raise EOFError("the stream ended")
        data = await self.reader.readexactly(size)
        await self.reader.readline()
        return data

    async def raw(self) -> bytes:
        """The next bytes the server sent (one chunk, any number of frames)."""
        return await self._chunk()

    async def next(self) -> Frame:
        while b"\n\n" not in self._buf:
            self._buf += await self._chunk()
        block, self._buf = self._buf.split(b"\n\n", 1)
        event, data, ident = "message", "", None
        for line in block.decode().split("\n"):
            k, _, v = line.partition(": ")
            if k == "event":
                event = v
            elif k == "data":
                data = v
            elif k == "id":
                ident = int(v)
        if not data and event == "message":
            return await self.next()  # `retry:` and `: ping`
        return Frame(event, json.loads(data), ident)

    def close(self) -> None:
        self.writer.close()
