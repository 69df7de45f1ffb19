"""A continued stream's chunks of text passed on in the read's callback: `Relay`, the
sink of one segment's answer (`upstream.Body.sink`), in front of `Plan._sunk`'s reading.

A stream's every chunk of text comes through `_sunk`'s `take`, then the stream's
`continuation_fast.Deferred.event`, then the client's `front.Stream.put`: some eight
Python frames a chunk, each run cold (a stream's chunks come one at a time, 8 a second
each), which is most of what the gateway spends on a stream beyond what a router does
(docs/performance.md, issue 42's thirteenth round). A relay takes the common read itself
(one whole chunk of text, on a stream whose chunks may be read later): it keeps the
chunk for that reading, counts it, takes its token ids out where the gateway asked for
them, frames it and writes it to the client, as those three would have; any other read
goes to `take`, whose answer it returns. What decides is read from the objects at each
read, as `take` reads it: nothing is cached across reads but what is fixed for the
segment (the client's connection, whether it is chunked).

`Relay` here is the rule a reader checks; `services.gateway._relay.Relay` (C, built
where a compiler is, as the project installs) is the same rule step for step, held
equal to it by tests/gateway/test_relay.py. With it come the lean client's read
callbacks compiled (`_relay.OnData`, `_relay.OnBody`: `upstream._Conn.data_received` and
`on_body`, step for step; tests/gateway/test_upstream_client.py runs the client on
both), so that a chunk of text passes from the replica's socket to the client's with no
Python frame; and the heads a whole request's path reads and writes (issue 42's
fourteenth round): the lean server's header callback and its answers' heads
(`_relay.OnHeader`, `_relay.Head`: `front._Conn.on_header`, `front.answer_head`) and the
lean client's (`_relay.OnAnswerHeader`, `_relay.RequestHead`: `upstream._Conn`'s header
`setdefault` with the decoding after it, `upstream.request_head`), held equal to those
by tests/gateway/test_heads.py. `--chunk-relay` picks (`RELAYS`): `auto` the compiled
ones where they were built, `compiled` those or a clear error, `python` the rules in
Python.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, cast

from services.core.continuation import _NULL_IDS, _null
from services.gateway.errors import GatewayError

# RELAYS are what --chunk-relay may say.
RELAYS = ("auto", "compiled", "python")


class Sink(Protocol):
    """What `relay` makes: a read's sink, with what its fast path leaves for the request's
    coroutine."""

    behind: bool
    failed: Exception | None

    def __call__(self, data: bytes, /) -> bool: ...


class Relay:
    """One segment's sink (the module's docstring): `take` the reading of any read not
    taken here, `plan` the stream's `continuation.Plan`, `st` its `Deferred`, `conn` the
    client's `front._Conn`, `chunked` whether its answer is sent in HTTP chunks,
    `decode` `continuation_fast`'s decode of a chunk's deciding fields, `unset`
    msgspec's UNSET, `max_kept` `continuation_fast.MAX_KEPT`."""

    __slots__ = (
        "behind",
        "chunked",
        "conn",
        "decode",
        "failed",
        "max_kept",
        "plan",
        "st",
        "take",
        "unset",
    )

    def __init__(
        self,
        take: Callable[[bytes], bool],
        plan: Any,
        st: Any,
        conn: Any,
        chunked: bool,
        decode: Callable[[bytes], Any],
        unset: Any,
        max_kept: int,
    ) -> None:
        self.take = take
        self.plan = plan
        self.st = st
        self.conn = conn
        self.chunked = chunked
        self.decode = decode
        self.unset = unset
        self.max_kept = max_kept
        self.behind = False
        """The client was behind after a write here: the request's coroutine drains."""
        self.failed: Exception | None = None
        """What a write here raised: raised in the request's coroutine."""

    def __call__(self, data: bytes) -> bool:
        plain = self._plain(data)
        if plain is None:
            return self.take(data)
        seg, null_ids = plain
        # Kept for the reading at a break (`Deferred.event`), counted, and written
        # (`front.Stream.put`).
        st = self.st
        st.kept.append(data)
        st.kept_bytes += len(data)
        seg.chunks += 1
        out = _NULL_IDS.sub(_null, data) if null_ids else data
        if self.chunked:
            out = b"%x\r\n%b\r\n" % (len(out), out)
        try:
            self.conn.transport.write(out)
        except Exception as e:  # raised in the request's coroutine, as `take` does
            self.failed = e
            return False
        if self.conn.write_paused:
            self.behind = True
            return False
        return True

    def _plain(self, data: bytes) -> tuple[Any, bool] | None:
        """The segment and whether to take the token ids out, when `data` is a chunk
        passed on here; None when it is `take`'s. Each check is one that `take`,
        `Deferred.event` or `front.Stream.put` makes before passing a chunk on as it
        came (or with its ids nulled) and keeping it unread."""
        plan, st, conn = self.plan, self.st, self.conn
        broken = plan.broken
        if type(broken) is not tuple or len(broken) != 3 or broken[2] or not plan.wrote:
            return None  # a part of an event left from the read before; no byte written
        if st.strip_counts or st.id is None:
            return None  # each chunk rewritten; the stream's id not read yet
        n = len(data)
        if not data.startswith(b"data: {") or data.find(b"\n\n") != n - 2 or b"\r" in data:
            return None  # not one whole event of the chunks' common form
        if conn.closing or conn.transport is None:
            return None  # `put` raises
        segments = st.segments
        if type(segments) is not list or len(segments) != 1:
            return None  # a moved stream's chunks are rewritten
        seg = segments[0]
        if seg.by_ids or st.kept_bytes + n > self.max_kept:
            return None  # rewritten into a chat's shape; read now, past the bound
        try:
            chunk = self.decode(data[5:])
        except Exception:
            return None  # not of the form read here: `take`'s to say
        choices = chunk.choices
        if (
            type(choices) is not list
            or not choices
            or chunk.error is not self.unset
            or isinstance(chunk.usage, dict)
            or chunk.prompt_token_ids is not None
        ):
            return None  # a break, the usage or a running count, the prompt's ids
        first = choices[0]
        if first.finish_reason == "abort" or first.prompt_token_ids is not None:
            return None
        return seg, first.token_ids is not None and bool(st.ids_wanted and st.strip_ids)


MakeSink = Callable[..., Sink]


class Picked(NamedTuple):
    """A relay as `pick` found it."""

    make: MakeSink
    """What makes a segment's sink (`Relay`, or the compiled one)."""
    readers: Any
    """The compiled module, whose `OnData`, `OnBody` and `OnAnswerHeader` are each
    upstream connection's read callbacks (`upstream._Conn`), `RequestHead` the lean
    client's request heads, and `OnHeader` and `Head` the lean server's header callback
    and answer heads (`front.Front`); None with the Python relay: the rules in Python."""
    name: str
    """`compiled` or `python`."""


def pick(name: str) -> Picked:
    """The relay `name` says (`RELAYS`); `GatewayError` with one line when `compiled` is
    asked for and was not built."""
    if name == "python":
        return Picked(Relay, None, "python")
    try:
        built = importlib.import_module("services.gateway._relay")
    except ImportError:
        if name == "compiled":
            raise GatewayError(
                "--chunk-relay compiled: the compiled relay was not built (it needs a C "
                "compiler and Python's headers when the project is installed: install them "
                "and reinstall, or --chunk-relay python)"
            ) from None
        return Picked(Relay, None, "python")
    return Picked(cast(MakeSink, built.Relay), built, "compiled")
