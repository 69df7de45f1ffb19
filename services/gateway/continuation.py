"""Streams that survive their replica, the gateway's side: a stream that breaks midway
(its connection reset, its end before `data: [DONE]`, an error event, a choice ended
with `finish_reason: "abort"`), or whose replica's drain is folded, goes on on another
replica of its model, and its client reads one answer.

Used by `services.gateway.server`, which asks `Continuations.plan` for each stream it
sends (the request's `PLAN`, kept on it when it may be continued) and tells
`Continuations.leaving` the replicas each fold takes out of routing, and by
`services.gateway.forward`, which hands a planned stream's answer to `Plan.stream`. The
rules (which requests, the resumed body, the sums) are `services.core.continuation`'s;
docs/gateway.md, "Streams that survive their replica".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import msgspec
from aiohttp import web

from services.core import catalog, routing
from services.core import continuation as rules
from services.core.continuation_fast import _DECODE, MAX_KEPT, Deferred
from services.core.view import View
from services.gateway import front, guard, relay, tokens
from services.gateway.exchange import FirstByte, Request, Stream
from services.gateway.keys import Key
from services.gateway.refusal import Refusal, Unreachable
from services.gateway.request import KEY, SPAN, TOOK
from services.gateway.upstream import Body
from services.gateway.use import Uses, stream_cached

if TYPE_CHECKING:
    from services.gateway.holding import Holding


class Forwarder(Protocol):
    """What a continued stream uses of `services.gateway.forward.Forwarder` (which hands
    it the stream, so is not imported here)."""

    @property
    def lines(self) -> guard.Lines: ...

    @property
    def first_byte(self) -> FirstByte: ...

    async def _post(
        self, request: Request, r: Any, body: bytes, path: str | None = None
    ) -> aiohttp.ClientResponse:
        """The replica's answer to `body` on `path` (the request's own when None)
        begun, or `Unreachable`."""
        ...


# SETTLE_S is how long a stream in flight on a replica whose drain is folded goes on
# there before it is moved (`--continuation-settle`): a stream about to end ends where it
# is, and the requests a drain cuts short are the long ones. The drain's grace then
# bounds the wait for short requests only.
SETTLE_S = rules.SETTLE_S

DONE_EVENT = b"data: [DONE]\n\n"
# _RELAY is what a relay reads a chunk with (`relay.Relay`'s last three).
_RELAY = (_DECODE, msgspec.UNSET, MAX_KEPT)
# TRIES is how many replicas one move asks: a replica that fails before the first byte
# of the resumed answer, another once more, as for a new request.
TRIES = 2


@dataclass(eq=False)
class Continuations:
    """The gateway's continued streams: which may be, those in flight per replica (to
    move at a drain), and how many each replica saw move away."""

    limit: int
    """Moves one request may make (`--continuation-limit`; 0: none)."""
    view: Callable[[], View]
    router: routing.Picker
    holding: Holding
    uses: Uses
    """Where each replica's part of a continued stream is counted, and each move
    (`replica.used`'s `moved_to`)."""
    lines: guard.Lines
    inflight_factor: float = routing.INFLIGHT_FACTOR
    settle_s: float = SETTLE_S
    max_text: int = rules.MAX_TEXT
    by_ids: bool = True
    """Continue by token ids where the engine gives them; False: by text always (what
    the engine tier compares them with)."""
    fast: bool = False
    """The gateway's `fast_path`: a stream's events read and written to its client in
    the callback that read them from its replica (`Plan._sunk`), where the lean client
    and server serve it (no coroutine woken for each chunk), and its chunks of text
    read only at a break (`continuation_fast.Deferred`). Off: each chunk read whole in
    the request's coroutine (`Plan._pass`'s loop, `rules.Stream`), the plain path the
    fast one is tested against."""
    relay: relay.MakeSink = relay.Relay
    """What makes a segment's sink on the fast path (`--chunk-relay`): the chunks of
    text passed on in it (`services.gateway.relay`), any other read to `Plan._sunk`'s."""
    on: dict[str, set[Plan]] = field(default_factory=dict)
    """The continued streams in flight, per replica now serving them."""
    moved: dict[str, int] = field(default_factory=dict)
    """Streams moved away from each replica since the start."""
    moved_by: dict[str, int] = field(default_factory=dict)
    """Moves since the start, by how they went on (`token_ids`, `text`)."""

    def plan(self, request: Request, m: catalog.Model, route: routing.Route, body: bytes) -> bytes:
        """Decide whether the stream `request` may be continued, say it in its span
        (`llmgw.continuation`: `on`, or why not) and keep its `Plan` on it if so; the
        body to send (one that asks a vLLM server for its running token count)."""
        span = request[SPAN]
        if self.limit <= 0:
            span.set_attribute("llmgw.continuation", "off")
            return body
        try:
            doc = msgspec.json.decode(body)
        except msgspec.DecodeError:
            span.set_attribute("llmgw.continuation", "body")
            return body
        why = rules.excluded(doc, request.path)
        span.set_attribute("llmgw.continuation", why or "on")
        if why is not None:
            return body
        d = self.view().state.models.get(m.name)
        counted = d is not None and d.runtime is not None and d.runtime.engine == "vllm"
        asked = counted and not rules.counts_asked(doc)
        # Token ids from vLLM, and from the simulated server (a model without a runtime
        # runs on simulated nodes only), which gives them as vLLM does.
        ids = self.by_ids and d is not None and (d.runtime is None or d.runtime.engine == "vllm")
        ids_for_it = ids and not rules.ids_asked(doc)
        size = len(body)  # the client's, for its prompt's estimate
        sent = rules.counting(doc) if asked else doc
        if ids_for_it:
            sent = rules.asking_ids(sent)
        if asked or ids_for_it:
            body = msgspec.json.encode(sent)
        request[PLAN] = Plan(
            self,
            m,
            route,
            doc,
            size,
            strip_counts=asked,
            ids=ids or rules.ids_asked(doc),
            strip_ids=ids_for_it,
        )
        return body

    def leaving(self, gone: list[str]) -> None:
        """Replicas the fold took out of routing: their continued streams move after
        `settle_s`."""
        loop = asyncio.get_running_loop()
        for rid in gone:
            for p in list(self.on.get(rid, ())):
                loop.call_later(self.settle_s, p.drained, rid)

    def _serving(self, p: Plan, rid: str | None, now: str | None) -> None:
        if rid is not None:
            held = self.on.get(rid)
            if held is not None:
                held.discard(p)
                if not held:
                    del self.on[rid]
        if now is not None:
            self.on.setdefault(now, set()).add(p)

    def elsewhere(self, m: catalog.Model, rid: str) -> bool:
        """Whether another replica of `m` than `rid` is routable now."""
        return any(r.id != rid for r in routing.candidates(self.view(), m))


def serving(request: Request, first: Any) -> Any:
    """The replica whose slot `request` holds at its end: the last it moved to, else
    `first`; None when it holds none (its stream broke and found no other)."""
    return request.get(SERVING, first)


@dataclass(eq=False)
class Plan:
    """One stream that may be continued."""

    of: Continuations
    model: catalog.Model
    route: routing.Route
    doc: dict[str, Any]
    body_len: int
    upstream: aiohttp.ClientResponse | None = None
    replica: Any = None
    strip_counts: bool = False
    """The gateway asked the server for a running token count in each chunk
    (`continuous_usage_stats`) on the client's behalf: taken out of what it gets."""
    ids: bool = False
    """Token ids were asked for (`return_token_ids`): kept, to continue by them."""
    strip_ids: bool = False
    """The gateway asked for them on the client's behalf: taken out of what it gets."""
    by_ids: bool = False
    """Its next segment answers a continuation by token ids (on `/v1/completions`)."""
    draining: bool = False
    """Its upstream was closed to move it off a draining replica."""
    wrote: bool = False
    """Its first byte from a replica went to its client."""
    broken: tuple[bytes, bytes, bytes] = (b"", b"", b"")
    """The event a segment broke at: as it came, what goes on of it when the stream is
    continued, and what came after it in the same read."""
    tail: bytes = b""
    """What came before a segment's `[DONE]` in the read that ended it, not written
    yet: it goes with the `[DONE]` and the stream's end in one write."""

    def drained(self, rid: str) -> None:
        """The settle time after `rid`'s drain is over: move now, if still there and
        another replica can take it (else it goes on where it is, as without)."""
        if self.replica is None or self.replica.id != rid or self.upstream is None:
            return
        if not self.of.elsewhere(self.model, rid):
            return
        self.draining = True
        self.upstream.close()

    async def stream(
        self,
        fw: Forwarder,
        request: Request,
        r: Any,
        upstream: aiohttp.ClientResponse,
        resp: Stream,
        strip: bool,
        sent: list[int],
    ) -> Stream:
        """Pass the stream on, continuing it on another replica at each break, up to the
        limit; count each replica's part at its end, however it ends."""
        st = (Deferred if self.of.fast else rules.Stream)(
            chat=request.path == rules.CHAT,
            max_text=self.of.max_text,
            strip_counts=self.strip_counts,
            ids_wanted=self.ids,
            strip_ids=self.strip_ids,
        )
        sent[1] = 0  # counted here, whatever happens
        tried = [r.id]
        moves = 0
        estimate = tokens.prompt_estimate(self.body_len)
        end = b""
        try:
            while True:
                st.begin(r, self.by_ids)
                self._on(r, upstream)
                what = await self._pass(fw, request, st, upstream, resp, moves < self.of.limit)
                if what == rules.DONE:
                    end = DONE_EVENT
                    break
                st.settle()  # what the segment's chunks said, read before it is used
                broke, self.draining = ("drain" if self.draining else st.broke), False
                nxt = None
                if st.unsafe is None and moves < self.of.limit:
                    if rules.exhausted(self.doc, st.sent, request.path):
                        end = st.ending() + DONE_EVENT
                        break
                    # Its slot there freed at once, not once another is found: a drain
                    # waiting for it ends now, and the wait for another may be long.
                    self.of.holding.done(r, self.route)
                    request[SERVING] = None
                    nxt = await self._move(fw, request, st, r, tried, broke)
                if nxt is None:
                    # Today's end: an error or abort event passed on and the rest of the
                    # stream with it, an end before [DONE] as it came, a reset a cut.
                    end = await self._cant(fw, request, st, upstream, resp, broke, r)
                    break
                await self._write(fw, request, resp, self.broken[1])
                moves += 1
                self.of.moved[r.id] = self.of.moved.get(r.id, 0) + 1
                self.of.uses.moved(r, nxt[0].id)
                upstream.close()
                r, upstream = nxt
                request[SERVING] = r
        finally:
            self._on(None, None)
            upstream.close()
            if moves:
                upstream.release()
            self._charge(request, st, estimate)
            sent[1] = 1
        if end:
            if not strip and (u := st.usage_chunk(estimate)) is not None:
                end = u + end
            end = self.tail + end
        # The last events, the [DONE] and the stream's end in one write (three before).
        if end:
            self._wrote(fw, request)
        try:  # noqa: SIM105 (not `contextlib.suppress`: three calls a stream)
            await resp.write_eof(end)
        except (ConnectionError, RuntimeError):
            pass
        return resp

    def _on(self, r: Any, upstream: aiohttp.ClientResponse | None) -> None:
        was = None if self.replica is None else self.replica.id
        self.of._serving(self, was, None if r is None else r.id)
        self.replica, self.upstream = r, upstream
        if r is not None and routing.gone(self.of.view(), r.id):
            # Picked before its replica's drain was folded, begun after: the fold did
            # not see it, so it moves after the settle time from now, not at the end of
            # the drain's grace.
            asyncio.get_running_loop().call_later(self.of.settle_s, self.drained, r.id)

    async def _pass(
        self,
        fw: Forwarder,
        request: Request,
        st: rules.Stream,
        upstream: aiohttp.ClientResponse,
        resp: Stream,
        may: bool,
        rest: bytes = b"",
    ) -> str:
        """Pass one replica's answer on, event by event, until its `[DONE]` (DONE) or
        its break (BREAK, `st.broke` saying what); with `may` false an error or abort
        event goes on as it came, as without continuation. `rest`: what came of it
        already and was not read yet."""
        self.broken = (b"", b"", b"")
        self.tail = b""
        if rest and (what := await self._events(fw, request, st, resp, may, rest)) is not None:
            return what
        content = upstream.content
        try:
            if self.of.fast and isinstance(content, Body) and isinstance(resp, front.Stream):
                if (what := await self._sunk(fw, request, st, content, resp, may)) is not None:
                    return what
            else:
                async for chunk in content.iter_any():
                    # The events read and written here, not in a coroutine of their own
                    # for each chunk (`_events` is the same for what came before).
                    what, out = self._read_on(st, may, chunk)
                    if out:
                        await resp.write(out)
                        self._wrote(fw, request)
                    if what is not None:
                        return what
        except (aiohttp.ClientError, TimeoutError) as e:
            st.broke = "reset"
            fw.lines.say(
                logging.INFO,
                ("broke", st.segments[-1].replica.id),
                "gateway: %s: stream broke: %s",
                st.segments[-1].replica.id,
                type(e).__name__,
            )
            return rules.BREAK
        if rest := self.broken[2]:
            await self._write(fw, request, resp, rest)
        st.broke = "eof"
        return rules.BREAK

    async def _sunk(
        self,
        fw: Forwarder,
        request: Request,
        st: rules.Stream,
        body: Body,
        resp: front.Stream,
        may: bool,
    ) -> str | None:
        """`_pass`'s loop, each read taken in the callback that read it (`Body.sink`):
        DONE or BREAK as it says, None at the answer's end; the request's coroutine is
        woken only then, when its client is behind, or when a write fails (raised here,
        as `resp.write` raises it)."""
        ended: str | None = None  # what ended the segment
        failed: Exception | None = None
        behind = False  # its client

        def take(data: bytes) -> bool:
            nonlocal ended, failed, behind
            try:
                if not self.broken[2] and data.find(b"\n\n") == len(data) - 2 and b"\r" not in data:
                    # One whole event (what a server sends in a write, most reads):
                    # `_read`'s case of one, without its split and its loop, and a chunk
                    # passed on (most events) read without `_one`'s frame.
                    said, out = st.event(data)
                    what: str | None = None
                    if said is not rules.PASS:
                        what, out = self._ended(st, may, data, said, out)
                        if what is not None:
                            self.broken, out = (data, out, b""), b""
                else:
                    what, out = self._read_on(st, may, data)
                if out:
                    behind = resp.put(out)
                    if not self.wrote:
                        self._wrote(fw, request)
            except Exception as e:  # raised in the request's coroutine, not the read's
                failed = e
                return False
            ended = what
            return what is None and not behind

        relayed = self._relay(take, st, resp)
        while True:
            data = body._take()
            if data is None:
                try:
                    await body.sink(take if relayed is None else relayed)
                finally:
                    body.unsink()
                failed, behind = self._left(relayed, failed, behind)
                if failed is not None:
                    raise failed
                if ended is not None:
                    return ended
                if behind:
                    behind = False
                    await resp.drain()
                continue
            if not data:
                return None
            if (what := await self._events(fw, request, st, resp, may, data)) is not None:
                return what

    def _relay(
        self, take: Callable[[bytes], bool], st: rules.Stream, resp: front.Stream
    ) -> relay.Sink | None:
        """The segment's sink: the chunks of text passed on in it, the rest in `take`
        (`relay.Relay`); None when all go to `take` (a HEAD's answer)."""
        to = resp.relayed()
        return None if to is None else self.of.relay(take, self, st, *to, *_RELAY)

    @staticmethod
    def _left(
        relayed: relay.Sink | None, failed: Exception | None, behind: bool
    ) -> tuple[Exception | None, bool]:
        """`failed` and `behind` with what the relay's own chunks left: a write's
        failure, its client behind."""
        if relayed is None:
            return failed, behind
        if relayed.behind:
            relayed.behind, behind = False, True
        return failed or relayed.failed, behind

    async def _events(
        self,
        fw: Forwarder,
        request: Request,
        st: rules.Stream,
        resp: Stream,
        may: bool,
        data: bytes,
    ) -> str | None:
        """Pass on the whole events of `data` (after what was left of the read before);
        DONE or BREAK when one ends the segment (what follows it kept in `broken`), else
        None (the part of an event not ended yet kept in `broken[2]`)."""
        what, out = self._read_on(st, may, data)
        await self._write(fw, request, resp, out)
        return what

    def _read_on(self, st: rules.Stream, may: bool, data: bytes) -> tuple[str | None, bytes]:
        """`_read` of the whole events of `data`, after the part of one that the read
        before left (`broken[2]`)."""
        rest = self.broken[2]
        whole, rest = rules.events(rest + data if rest else data)
        return self._read(st, may, whole, rest)

    def _read(
        self, st: rules.Stream, may: bool, whole: list[bytes], rest: bytes
    ) -> tuple[str | None, bytes]:
        """Read the whole events `whole` (`rest` the part of one not ended yet): what
        ends the segment (DONE, BREAK; what follows it kept in `broken`) or None (`rest`
        kept in `broken[2]`), and the bytes to write now. What comes before a `[DONE]`
        is kept in `tail` instead, to go with it."""
        out: list[bytes] = []
        for i, raw in enumerate(whole):
            what, got = self._one(st, may, raw)
            if what is not None:
                self.broken = (raw, got, b"".join(whole[i + 1 :]) + rest)
                if what == rules.DONE:
                    self.tail = b"".join(out)
                    return what, b""
                return what, b"".join(out)
            out.append(got)
        self.broken = (b"", b"", rest)
        return None, out[0] if len(out) == 1 else b"".join(out)

    @staticmethod
    def _one(st: rules.Stream, may: bool, raw: bytes) -> tuple[str | None, bytes]:
        """One event read: DONE or BREAK when it ends the segment (with what goes on of
        it), else None and the bytes to pass on for it (with `may` false, an error or
        abort event goes on as it came)."""
        what, got = st.event(raw)
        return Plan._ended(st, may, raw, what, got)

    @staticmethod
    def _ended(
        st: rules.Stream, may: bool, raw: bytes, what: str, got: bytes
    ) -> tuple[str | None, bytes]:
        """`_one` of the event `raw`, which `st.event` read as `what` and `got`."""
        if what == rules.DONE:
            return what, got
        if what == rules.BREAK:
            return (what, got) if may and st.unsafe is None else (None, raw)
        return None, got

    async def _write(self, fw: Forwarder, request: Request, resp: Stream, data: bytes) -> None:
        if not data:
            return
        await resp.write(data)
        self._wrote(fw, request)

    def _wrote(self, fw: Forwarder, request: Request) -> None:
        """Its replica's bytes went to the client: the first time, its first byte."""
        if not self.wrote:
            self.wrote = True
            fw.first_byte(request)

    async def _move(
        self,
        fw: Forwarder,
        request: Request,
        st: rules.Stream,
        r: Any,
        tried: list[str],
        broke: str | None,
    ) -> tuple[Any, aiohttp.ClientResponse] | None:
        """Another replica's answer to the resumed request, begun: picked among the
        routable ones but those tried, else from the waiting room (bounded by its
        model's predicted start), and one more tried when the first fails before its
        first byte, as a new request's is; None when none can be had."""
        # By token ids when every one is known and the request has a limit to reduce
        # (a chat without one runs to the model's length, which a completion cannot
        # say); else by text.
        by_ids = st.by_ids and rules.by_ids_limit(self.doc, request.path) is not None
        if by_ids and st.prompt_ids is not None:
            doc = rules.resumed_ids(self.doc, request.path, st.prompt_ids, st.ids, st.sent)
            path = rules.COMPLETIONS
        else:
            by_ids = False
            doc = rules.resumed(self.doc, request.path, st.text, st.sent)
            path = request.path
        if self.strip_counts:
            doc = rules.counting(doc)
        body = msgspec.json.encode(doc)
        for _ in range(TRIES):
            view = self.of.view()
            limit = routing.admit_limit(view, self.model, self.of.inflight_factor)
            nxt = self.of.router.pick(view, self.model, self.route, avoid=tried, limit=limit)
            if nxt is None:
                key: Key | None = request.get(KEY)
                try:
                    nxt, _ = await self.of.holding.wait(
                        request, self.model, self.route, False, key, avoid=tuple(tried)
                    )
                except Refusal:
                    return None
            tried.append(nxt.id)
            up = await self._begin(fw, request, nxt, body, path)
            if up is None:
                continue
            how = "token_ids" if by_ids else "text"
            fw.lines.say(
                logging.INFO,
                ("moved", r.id),
                "gateway: %s: stream moved to %s (%s, by %s)",
                r.id,
                nxt.id,
                broke,
                how,
            )
            span = request[SPAN]
            span.set_attribute("llmgw.moves", len(tried) - 1)
            span.set_attribute("llmgw.moved_to", nxt.id)
            span.set_attribute("llmgw.moved_why", str(broke))
            span.set_attribute("llmgw.moved_by", how)
            self.by_ids = by_ids
            self.of.moved_by[how] = self.of.moved_by.get(how, 0) + 1
            return nxt, up
        return None

    async def _begin(
        self, fw: Forwarder, request: Request, nxt: Any, body: bytes, path: str
    ) -> aiohttp.ClientResponse | None:
        """`nxt`'s answer to `body` on `path` begun as a stream; None (its slot freed)
        when it cannot be asked or answers anything else."""
        try:
            up = await fw._post(request, nxt, body, path)
        except (Unreachable, Refusal):
            self.of.holding.done(nxt, self.route)
            return None
        except BaseException:
            # A client gone while it was asked: its slot there is freed with it.
            self.of.holding.done(nxt, self.route)
            raise
        if up.status != 200 or not up.headers.get("Content-Type", "").startswith(
            "text/event-stream"
        ):
            up.close()
            up.release()
            self.of.holding.done(nxt, self.route)
            return None
        return up

    async def _cant(
        self,
        fw: Forwarder,
        request: Request,
        st: rules.Stream,
        upstream: aiohttp.ClientResponse,
        resp: Stream,
        broke: str | None,
        r: Any,
    ) -> bytes:
        """The stream ends as it would without continuation; the `[DONE]` still to send
        when its replica sent one."""
        request[SPAN].set_attribute("llmgw.continued", False)
        if broke in ("error", "abort"):
            raw, _, after = self.broken
            await self._write(fw, request, resp, raw)
            what = await self._pass(fw, request, st, upstream, resp, False, after)
            return DONE_EVENT if what == rules.DONE else b""
        if broke == "eof":
            return b""
        fw.lines.say(logging.WARNING, ("cut", r.id), "gateway: %s: stream cut: %s", r.id, broke)
        if request.transport is not None:
            request.transport.close()
        return b""

    def _charge(self, request: Request, st: rules.Stream, estimate: int) -> None:
        """Each replica its part (`rules.Stream.charges`), the key the whole."""
        took = 0
        for i, (rep, n, tin, tout) in enumerate(st.charges(estimate)):
            cached = None
            if i == 0 and len(st.segments) == 1 and st.usage_raw is not None:
                cached = stream_cached(st.usage_raw)
            self.of.uses.used(rep, tin, tout, request.get(KEY), cached, n)
            took += tin + tout
        request[TOOK] = took


PLAN = web.RequestKey("llmgw_continuation", Plan)
"""The request's `Plan`, when its stream may be continued."""
SERVING = web.RequestKey("llmgw_serving", object)
"""The replica serving a continued stream now, when it moved: its slot is the one freed
at the end."""
