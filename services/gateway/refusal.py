"""A request refused, in the OpenAI error shape, and the gateway's named refusals.

Used by every room of the gateway (`services.gateway.server`, `.request`, `.forward`,
`.holding`): a `Refusal` raised anywhere on a request's path is answered by the server's
middleware as `{"error": {"message", "type", "code"}}` with the status, the reason in
`x-llmgw-reason` and any headers it carries (Retry-After).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from services.core import coldstart
from services.gateway import guard
from services.gateway.exchange import Answer, Request, Stream, Whole, as_aiohttp, json_whole

# MAX_ANSWER bounds a non-streamed answer read whole from a replica (64 MiB: a batch of
# embeddings); past it the answer is garbage to the gateway (502).
MAX_ANSWER = 64 * 1024 * 1024
# RETRY_AFTER_S is what a 503 tells a client to wait: about a scheduler pass.
RETRY_AFTER_S = 1


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

    def whole(self) -> Whole:
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
        return json_whole(body, self.status, {"x-llmgw-reason": said, **self.headers})

    def response(self) -> web.StreamResponse:
        """The refusal as aiohttp's server sends it."""
        return as_aiohttp(self.whole())


class Answered(Exception):
    """A held stream answered already (its refusal sent as an SSE error event)."""

    def __init__(self, resp: Stream) -> None:
        super().__init__("answered")
        self.resp = resp


class Unreachable(Exception):
    """A replica failed before its first byte: worth one more try elsewhere."""

    def __init__(self, why: str, *, garbage: bool) -> None:
        super().__init__(why)
        self.garbage = garbage


def too_big(limit: int) -> Refusal:
    return Refusal(413, f"the body is over {limit} bytes", "body_too_large")


def answer_too_big(rid: str) -> Refusal:
    return Refusal(
        502, f"replica {rid} answered over {MAX_ANSWER} bytes", "bad_upstream", kind="api_error"
    )


def unplaceable(u: coldstart.Unplaceable) -> Refusal:
    headers = {}
    if u.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(u.retry_after_s)))
    return Refusal(503, u.reason, u.code, kind="api_error", headers=headers, words=u.reason)


def queue_full(said: str, retry_after: int) -> Refusal:
    """429: a model's line, or an owner's share of it, is full."""
    return Refusal(
        429,
        said,
        "queue_full",
        kind="rate_limit_error",
        headers={"Retry-After": str(retry_after)},
        words=said,
    )


def no_replica(model: str, last: Unreachable | None) -> Refusal:
    """What a request gets when no replica took it: 502 for the last one's garbage, else
    503 with Retry-After."""
    if last is not None and last.garbage:
        return Refusal(
            502, f"the replica answered garbage: {last}", "bad_upstream", kind="api_error"
        )
    why = (
        f"no replica of {model} answered ({last})"
        if last is not None
        else f"no replica of {model} is ready now"
    )
    return Refusal(
        503, why, "no_replica", kind="api_error", headers={"Retry-After": str(RETRY_AFTER_S)}
    )


_JSON_TYPES = {str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def invalid_type(field: str, expected: str, value: Any) -> Refusal:
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


# BOUNDARY is where the app keeps the HTTP edge's check (`guard.Boundary`), which every
# request meets first, in `openai_errors`.
BOUNDARY = web.AppKey("llmgw_boundary", guard.Boundary)


@web.middleware
async def openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every refusal in the OpenAI error shape, aiohttp's own (404, 405) included."""
    try:
        why = request.app[BOUNDARY].refusal(request)
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


# Routes are the gateway's paths, each with its methods' handlers (`Gateway.routes`).
Routes = Mapping[str, Mapping[str, Callable[[Request], Awaitable[Answer]]]]


async def dispatch(request: Request, routes: Routes, boundary: guard.Boundary) -> Answer:
    """The lean server's `openai_errors` and router (`services.gateway.front`): the
    edge's check first, then 404 for a path the gateway has not, 405 for a method the
    path has not (HEAD where it has GET, as aiohttp's `add_get`), every refusal in the
    OpenAI error shape, in the words aiohttp's would be."""
    try:
        why = boundary.refusal(request)
        if why is not None:
            raise Refusal(*why)
        methods = routes.get(request.path)
        if methods is None:
            raise Refusal(404, f"{request.method} {request.path}: Not Found", "not_found")
        handler = methods.get(request.method)
        if handler is None and request.method == "HEAD":
            handler = methods.get("GET")
        if handler is None:
            raise Refusal(
                405,
                f"{request.method} {request.path}: Method Not Allowed",
                "method_not_allowed",
            )
        return await handler(request)
    except Refusal as e:
        return e.whole()
