"""One exchange as the gateway's handlers see it, whichever server carries it: the
request they read (`Request`), and the answer they give, whole (`Whole`) or streamed
(`Stream`, begun by `begin`).

The seam between the handlers (`services.gateway.server`, `.request`, `.forward`,
`.continuation`, `.holding`, `.pages`, `.refusal`) and the two HTTP servers
`--server` picks: aiohttp's (the reference; its `web.Request` is a `Request` as it is,
a `Whole` becomes its `web.Response` in `as_aiohttp`, a stream is its
`web.StreamResponse`) and the lean one (`services.gateway.front`, whose request and
stream are these and nothing more). What the handlers use of a request is this much:
its method, path, headers, body (`content`: `is_eof`, `read_nowait`, `readany`), its
connection (`transport`, closed to cut a broken stream), and what is kept on it while it
is served (`request[KEY]`, the `web.RequestKey`s of `services.gateway.request`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar, overload

from aiohttp import web

T = TypeVar("T")

# JSON_UTF8 is the type a JSON answer says (aiohttp's `json_response`'s).
JSON_UTF8 = "application/json; charset=utf-8"


class Body(Protocol):
    """A request's body as it comes (aiohttp's `StreamReader`, the part read)."""

    def is_eof(self) -> bool: ...

    def read_nowait(self, n: int = -1) -> bytes: ...

    async def readany(self) -> bytes: ...


class Request(Protocol):
    """What the handlers read of a request, and keep on it."""

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def content_length(self) -> int | None: ...

    @property
    def content(self) -> Body: ...

    @property
    def transport(self) -> asyncio.Transport | None: ...

    def __getitem__(self, key: web.RequestKey[T]) -> T: ...

    def __setitem__(self, key: web.RequestKey[T], value: T) -> None: ...

    @overload
    def get(self, key: web.RequestKey[Any], /) -> Any: ...

    @overload
    def get(self, key: web.RequestKey[Any], default: Any, /) -> Any: ...


class Stream(Protocol):
    """An answer sent as it comes (its status and headers sent by `begin`)."""

    @property
    def status(self) -> int: ...

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self, data: bytes = b"") -> None: ...


class Whole:
    """An answer sent whole: its status, body and headers (a Content-Length and a Date
    are the server's to add)."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self, body: bytes, status: int = 200, headers: Mapping[str, str] | None = None
    ) -> None:
        self.body = body
        self.status = status
        self.headers: Mapping[str, str] = headers if headers is not None else {}


Answer = Whole | Stream


def json_whole(doc: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Whole:
    """`doc` as JSON, the bytes aiohttp's `json_response` sent (`json.dumps`)."""
    said = {"Content-Type": JSON_UTF8}
    if headers:
        said.update(headers)
    return Whole(json.dumps(doc).encode(), status, said)


class FirstByte(Protocol):
    """What marks an answer's first byte: at once, or later with the time it came
    (`at`, `time.perf_counter()`'s)."""

    def __call__(self, request: Request, at: float | None = None, /) -> None: ...


def begin(request: Request, status: int, headers: Mapping[str, str]) -> Awaitable[Stream]:
    """The answer to `request` begun as a stream: its status and headers sent. The lean
    server's own coroutine, returned (no coroutine around it, nor a cast's call: every
    stream)."""
    # The lean request told apart by its method, as in `sent_now`.
    lean: Callable[[int, Mapping[str, str]], Awaitable[Stream]] | None = getattr(
        request, "begin", None
    )
    if lean is None:
        return _prepared(request, web.StreamResponse(status=status, headers=headers))  # type: ignore[arg-type]
    return lean(status, headers)


async def _prepared(request: web.BaseRequest, resp: web.StreamResponse) -> Stream:
    await resp.prepare(request)
    return resp


async def send_now(request: Request, answer: Whole) -> Answer:
    """`answer` sent to the client now, before what its handler does after it (its
    accounting): what the handler returns for it, which its server sends no more of
    (the lean server's `answer` itself, not sent, when the client is gone: it finds it
    so, as it does for any answer)."""
    got = sent_now(request, answer)
    if got is not None:
        return got
    resp = web.Response(body=answer.body, status=answer.status, headers=answer.headers)
    try:
        await resp.prepare(request)  # type: ignore[arg-type]
        await resp.write_eof()
    except ConnectionError:
        pass  # the client is gone: aiohttp's server finds it so, as for any answer
    return resp


def sent_now(request: Request, answer: Whole) -> Answer | None:
    """`send_now` without a coroutine, where the server sends at once (the lean one): what
    the handler returns; None on aiohttp's server (`send_now` sends it there)."""
    # Told apart by the lean request's method, not by `isinstance`: aiohttp's request is
    # a `MutableMapping`, which an ABC's check (in Python) would walk for every answer.
    send: Callable[[Whole], Whole] | None = getattr(request, "send_now", None)
    if send is None:
        return None
    try:
        return send(answer)
    except ConnectionError:
        return answer


def as_aiohttp(answer: Answer) -> web.StreamResponse:
    """`answer` as aiohttp's server sends it."""
    if isinstance(answer, Whole):
        return web.Response(body=answer.body, status=answer.status, headers=answer.headers)
    assert isinstance(answer, web.StreamResponse)
    return answer
