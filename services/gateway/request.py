"""One request as the gateway reads it: what is kept on it while it is served, its body
parsed once, and its route key.

Used by `services.gateway.server` for each request. A gateway is a pipe (STYLE.md): of
a body it parses only `model`, `stream`, `stream_options`, `user` and what its key's
`tpm` reserves (`max_tokens`, `max_completion_tokens`, `n`: `services.gateway.tokens`),
once, into a `Head`; what routing reads of the request is then its `Route`
(`services.core.routing`), whose prompt is read from the body only if the routing rule
asks for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any

import msgspec
from aiohttp import web
from opentelemetry import trace

from services.bus import tracing
from services.core import routing
from services.gateway import guard
from services.gateway.exchange import Request, Stream
from services.gateway.keys import Key
from services.gateway.refusal import RETRY_AFTER_S, Refusal, invalid_type, too_big

# What is kept on the aiohttp request while it is served:
MODEL = web.RequestKey("llmgw_model", str)
"""The model's label in the metrics."""
T0 = web.RequestKey("llmgw_t0", float)
"""perf_counter() at its arrival."""
SPAN = web.RequestKey("llmgw_span", trace.Span)
PICKED_AT = web.RequestKey("llmgw_picked_at", int)
"""The seq of the view its replica was picked from, said to the client in `x-llmgw-seq`
(a drain folded at a seq past it had not been folded at the pick)."""
WOKEN = web.RequestKey("llmgw_woken", float)
"""perf_counter() of the fold of the ready that released it, when it was the first
that ready released; its first byte then measures the wake."""
STATUS = web.RequestKey("llmgw_status", int)
"""The status of a refusal sent inside a held stream's 200 (as an SSE error)."""
SENT = web.RequestKey("llmgw_sent", tuple)
"""The replicas a woken request was sent to (its wake's send counted once)."""
KEY = web.RequestKey("llmgw_key", Key)
TOOK = web.RequestKey("llmgw_took", int)
"""The tokens (prompt and completion) its answer took, what its key's reservation is
settled to at its end."""
HELD = web.RequestKey("llmgw_held", int)
"""The bytes of the budget (`guard.Budget`) its body holds."""
ROUTE = web.RequestKey("llmgw_route", routing.Route)
"""Its route key, for the routing rule to be told what its answer said."""
ASKED = web.RequestKey("llmgw_asked", float)
"""perf_counter() as it was sent to its replica (the last one tried)."""
TO = web.RequestKey("llmgw_to", str)
"""The replica it was sent to (the last one tried)."""
ROUTED = web.RequestKey("llmgw_routed", str)
"""Why its replica was picked, said in `x-llmgw-route` (a rule that says, `prefix`)."""


class Head(msgspec.Struct, forbid_unknown_fields=False):
    """What the gateway reads of a request; every other field is passed on unread."""

    model: Any = None
    stream: Any = False
    user: Any = None
    stream_options: Any = msgspec.UNSET
    max_tokens: Any = None
    max_completion_tokens: Any = None
    n: Any = None


_head = msgspec.json.Decoder(Head)


class Read(Head, forbid_unknown_fields=False):
    """`Head` and what a routing rule that reads the prompt reads of the body
    (`routing.Route`'s material: the chat's messages, a completion's prompt, its
    `cache_salt`), in the one parse of it."""

    messages: Any = None
    prompt: Any = None
    cache_salt: Any = None


_read = msgspec.json.Decoder(Read)

_TOKENS = "a whole number of tokens (0 or more)"


def _tokens(value: Any) -> bool:
    return value.__class__ is int and value >= 0


def parse(body: bytes, material: bool = False) -> Head:
    """What the gateway reads of a body; 400 for anything but a JSON object. JSON is
    UTF-8 throughout (RFC 8259), also in the fields the gateway skips; a key given twice
    counts as its last value, as it does for the replica's parser. `material`: the
    prompt's material read in the same parse (a `Read`), for a rule that reads it; one
    nested too deep to read that way is read as a `Head` alone (the rule then reads what
    it can of it itself, as without)."""
    try:
        head: Head
        if material:
            try:
                head = _read.decode(body)
            except RecursionError:
                head = _head.decode(body)
        else:
            head = _head.decode(body)
        body.decode("utf-8")
    except msgspec.ValidationError:
        raise Refusal(400, "the body must be a JSON object", "invalid_json") from None
    except msgspec.DecodeError as e:
        raise Refusal(400, f"the body is not JSON: {e}", "invalid_json") from None
    except UnicodeDecodeError as e:
        raise Refusal(
            400, f"the body is not JSON: byte {e.start} is not UTF-8", "invalid_json"
        ) from None
    except RecursionError:
        raise Refusal(
            400, "the body is not JSON the gateway takes: nested too deep", "invalid_json"
        ) from None
    if not isinstance(head.model, str) or not head.model:
        raise Refusal(400, "the request names no model (a string `model` field)", "missing_model")
    # Read as the server will, or refused: a server that reads `"stream": "true"` as true
    # streams an answer the gateway would pass, and count, as a whole one.
    if head.stream.__class__ is not bool:
        if head.stream is not None:
            raise invalid_type("stream", "a boolean", head.stream)
        head.stream = False
    if head.max_tokens is not None and not _tokens(head.max_tokens):
        raise invalid_type("max_tokens", _TOKENS, head.max_tokens)
    if head.max_completion_tokens is not None and not _tokens(head.max_completion_tokens):
        raise invalid_type("max_completion_tokens", _TOKENS, head.max_completion_tokens)
    return head


def route(request: Request, model: str, head: Head, body: bytes, key: Key | None) -> routing.Route:
    """The request's route key: its declared model, its session (`x-session-id`, else
    the body's `user`), its key's owner, its path, and its body for a rule that reads
    the prompt."""
    session = request.headers.get("x-session-id") or (
        head.user if isinstance(head.user, str) and head.user else None
    )
    return routing.Route(
        model,
        session=session,
        owner=None if key is None else key.owner,
        path=request.path,
        body=body,
        material=head if head.__class__ is Read else None,
    )


def client_timeout(request: Request) -> float | None:
    """The seconds the client says it waits for an answer (the openai package sends its
    read timeout as `x-stainless-read-timeout`); None when it says nothing usable."""
    raw = request.headers.get("x-stainless-read-timeout")
    if raw is None:
        return None
    try:
        t = float(raw)
    except ValueError:
        return None
    return t if math.isfinite(t) and t > 0 else None


async def sse_error(request: Request, resp: Stream, e: Refusal) -> None:
    """`e` as the one SSE event of a stream whose 200 is sent (`data: {"error": ...}`,
    which the openai package raises as an APIError), and the stream's end; the request's
    status and span say the refusal, as a refusal before the 200 would."""
    request[STATUS] = e.status
    request[SPAN].set_attribute("llmgw.reason", e.reason)
    doc = {"error": {"message": e.message, "type": e.kind, "code": e.reason}}
    with contextlib.suppress(ConnectionError, RuntimeError):
        await resp.write(b"data: " + msgspec.json.encode(doc) + b"\n\n")
        await resp.write_eof()


def over_budget(budget: guard.Budget) -> Refusal:
    return Refusal(
        503,
        f"the gateway holds {budget.held} bytes of request bodies, its budget is "
        f"{budget.capacity} (--body-budget); try again shortly",
        "body_budget",
        kind="server_error",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def body_now(request: Request, max_body: int, budget: guard.Budget) -> bytes | None:
    """`read_body` without a coroutine for a body of a said length that came whole with
    its head (most: the parser has read it to its end, no more than its length): its
    bytes, never empty; None for any other (`read_body` reads it), nothing taken."""
    said = request.content_length
    content = request.content
    if not said or not content.is_eof():
        return None
    if said > max_body:
        raise too_big(max_body)
    if not budget.take(said):
        raise over_budget(budget)
    request[HELD] = said
    return content.read_nowait()


async def read_body(
    request: Request, max_body: int, budget: guard.Budget, timeout_s: float
) -> bytes:
    """The whole body, its bytes held in `budget` (`HELD`, given back by the server when
    the request ends): all of them before it is read when its length is said, else chunk
    by chunk as they come. 413 past `max_body`, 503 past the budget, 408 past
    `timeout_s`."""
    said = request.content_length
    if said is not None and said > max_body:
        raise too_big(max_body)
    if said is not None:
        if not budget.take(said):
            raise over_budget(budget)
        request[HELD] = said
    content = request.content
    if said is not None and content.is_eof():
        # The body came whole with its head (the parser has read it to its end, no more
        # than its length): nothing to wait for, so no timer to arm.
        return content.read_nowait()
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await content.readany():
                size += len(chunk)
                if size > max_body:
                    raise too_big(max_body)
                if said is None:
                    if not budget.take(len(chunk)):
                        raise over_budget(budget)
                    request[HELD] = size
                chunks.append(chunk)
    except TimeoutError:
        raise Refusal(
            408, f"the body did not arrive within {timeout_s:g}s", "body_timeout"
        ) from None
    return b"".join(chunks)


# NO_SPAN stands for a request's span when none is made: a span that records nothing,
# as the no-op tracer's would be, without the context it would be attached to.
NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)


def span_of(request: Request, fast_path: bool) -> contextlib.AbstractContextManager[trace.Span]:
    """The request's span, made current: SERVER kind, a child of the client's
    `traceparent` when it sent one. With nothing recording spans (no exporter set)
    and no traceparent, the no-op tracer's span records nothing and carries no
    context, so the fast path makes none (13 us and a dozen objects a request, held
    as long as a stream)."""
    traced = "traceparent" in request.headers
    if fast_path and not traced and not tracing.enabled():
        return NO_SPAN
    return tracing.tracer().start_as_current_span(
        f"POST {request.path}",
        context=tracing.extract(request.headers) if traced else None,
        kind=trace.SpanKind.SERVER,
    )
