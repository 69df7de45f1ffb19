"""The waiting room's orchestration: requests held until a replica can take them.

Used by `services.gateway.server`. A model that cannot take a request now does not
refuse it: the request waits in the model's line (`services.gateway.waiting`: each key's
owner in turn), up to `queue_per_model`, for as long as the model's start is predicted
to take (`services.core.coldstart`) and no longer than the client waits; a held stream
is sent its 200 and SSE comments (`: waiting`) every `keepalive_s` meanwhile. While
requests wait the gateway publishes `model.demanded` (at once for the first, then at
most once a second), which is what wakes an on-demand model from zero. The fold of a
replica's ready releases the line (`Holding.on_fold`), at most `target_inflight` x
`INFLIGHT_FACTOR` in flight a replica, the rest as requests end (`Holding.done`). Past
the line's length or its wait, a 429 with Retry-After the predicted start; a model the
plane has said it cannot place, a 503 with that decision's reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import nats.errors

from schemas import events as ev
from services.bus import Publisher
from services.bus.errors import BusError
from services.clock import new_id, utc_now
from services.core import catalog, coldstart, routing
from services.core.view import View
from services.gateway import guard
from services.gateway.exchange import Request, Stream, begin
from services.gateway.keys import Key
from services.gateway.metrics import Counts, Labelled, Metrics
from services.gateway.refusal import Answered, Refusal, queue_full, unplaceable
from services.gateway.request import PICKED_AT, SPAN, WOKEN, client_timeout, sse_error
from services.gateway.use import SOURCE
from services.gateway.waiting import Full, Line, Waiter, WaitingRoom

# MIN_WAIT_S is the least a held request waits for a model with a history of starts: a
# model that loads in a second still needs the scheduler's pass and, to make room, a
# victim's drain (30 s by default) before its start even begins.
MIN_WAIT_S = 30.0
# DEMAND_INTERVAL_S is the least time between two `model.demanded` of one model.
DEMAND_INTERVAL_S = 1.0
# CLIENT_TIMEOUT_SHARE is how much of the timeout a client says it reads with (the
# openai package's `x-stainless-read-timeout`) a held request may spend waiting: it is
# answered 429 a little before the client would give up on it unanswered.
CLIENT_TIMEOUT_SHARE = 0.9

# SSE_HEADERS are a held stream's, sent when it starts waiting.
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
KEEPALIVE = b": waiting\n\n"

# WAKES are the events after whose fold a line may be served: a replica ready (or one
# leaving, which frees nothing but changes who is routable), a node back, a model's
# declaration (its target_inflight).
WAKES = (
    ev.ReplicaStateEvent,
    ev.ReplicaDrainEvent,
    ev.NodeUncordonedEvent,
    ev.NodeFoundEvent,
    ev.ModelDeclaredEvent,
)
# VERDICTS are the events after whose fold a line may learn its model cannot be placed.
VERDICTS = (ev.PreemptionDecidedEvent, ev.HoldCreatedEvent, ev.ModelRemovedEvent)


class Demand(Protocol):
    """What the other gateways hold and route (`services.gateway.share.Sharing`)."""

    def waiting(self, model: str) -> int:
        """Requests for `model` the other gateways hold now."""
        ...

    def reports(self, model: str, waiting: int) -> bool:
        """Whether this gateway, holding `waiting` of `model`'s requests, is the one that
        says the fleet's demand for it."""
        ...

    def inflight(self) -> Mapping[str, int]:
        """Requests the other gateways have in flight per replica."""
        ...

    def held_by_owner(self, model: str) -> Mapping[str | None, int]:
        """Requests for `model` the other gateways hold, per owner (None: no key)."""
        ...


class Tunables(Protocol):
    """The settings a line is held and served by, read as each is needed (the gateway's
    own fields, which a test may change while it serves)."""

    keepalive_s: float
    min_wait_s: float
    demand_interval_s: float
    inflight_factor: float


@dataclass(eq=False)
class Holding:
    """The lines of held requests, and who serves them: the router that picks their
    replicas, the view it picks from, and the demand each line publishes."""

    view: Callable[[], View]
    """The follower's view now."""
    router: routing.Picker
    room: WaitingRoom
    publisher: Publisher
    metrics: Metrics
    labelled: Labelled
    counts: Counts
    lines: guard.Lines
    settings: Tunables
    stopping: bool = False
    """Set as the gateway stops: the demand reports end."""
    fleet: Demand | None = None
    """The other gateways' waiting requests (`services.gateway.share`): with them, one
    gateway of those holding a model's requests reports the fleet's, the others none."""

    async def wait(
        self,
        request: Request,
        m: catalog.Model,
        route: routing.Route,
        stream: bool,
        key: Key | None = None,
        avoid: tuple[str, ...] = (),
    ) -> tuple[Any, Stream | None]:
        """Hold the request in its model's line until a replica can take it: the
        replica (counted in flight) and, for a stream, the 200 already sent. A Refusal
        past the line's length or its wait, or for a model that cannot be placed.
        `avoid`: replicas it may not be given (a continued stream's broken ones)."""
        now = utc_now()
        self._placeable(m, now)
        look = coldstart.outlook(self.view(), m, now, floor_s=self.settings.min_wait_s)
        bound = look.bound_s
        told = client_timeout(request) if not stream else None
        if told is not None:
            bound = min(bound, told * CLIENT_TIMEOUT_SHARE)
        w = self._join(m, route, now, key, look.retry_after)
        w.avoid = avoid
        line = self.room.lines[m.name]
        request[SPAN].set_attribute("llmgw.held", True)
        held_gauge = self.labelled.of(self.metrics.held, m.name)
        held_gauge.inc()
        if line.demand is None:
            line.demand = asyncio.create_task(self._demand(line), name=f"demand {m.name}")
        self.serve(line)  # a slot may be free behind requests that have left
        resp: Stream | None = None
        taken = False
        try:
            if stream and not w.fut.done():
                resp = await begin(request, 200, SSE_HEADERS)
            await self._held(w, resp, bound)
            if not w.fut.done():
                self.room.leave(w)
                raise self._too_long(m, bound)
            r = w.fut.result()  # a Refusal given to the whole line raises here
            request[PICKED_AT] = w.seq
            taken = True
            if w.woken_at is not None:
                request[WOKEN] = w.woken_at
            return r, resp
        except Refusal as e:
            if resp is None:
                raise
            await sse_error(request, resp, e)
            raise Answered(resp) from None
        finally:
            held_gauge.dec()
            if not taken:
                self._left(w)

    def _placeable(self, m: catalog.Model, now: datetime) -> None:
        """A Refusal at once for a model with no replica to route to that cannot have
        one soon: its replicas on a lost node within its grace, or a verdict of the
        plane that it cannot be placed."""
        view = self.view()
        # A model with replicas to route to is busy, not unplaced: its requests wait for
        # a slot, whatever the plane says of placing more.
        if routing.candidates(view, m):
            return
        # Replicas on a lost node within its grace: counted live, so the plane places no
        # other until the grace ends, and nothing a request waits 30 s for. Said at once,
        # naming the node, with when a replica should be there again.
        lost = coldstart.stranded(view, m, now)
        if lost is not None:
            said = lost.words(m.name, now)
            raise Refusal(
                503,
                said,
                "node_lost",
                kind="api_error",
                headers={"Retry-After": str(lost.retry_after)},
                words=said,
            )
        line = self.room.lines.get(m.name)
        since = line.since if line is not None and line.since is not None else now
        cannot = coldstart.unplaceable(view, m, now, since)
        if cannot is not None:
            raise unplaceable(cannot)

    def _join(
        self,
        m: catalog.Model,
        route: routing.Route,
        now: datetime,
        key: Key | None,
        retry_after: int,
    ) -> Waiter:
        """The request in its model's line; 429 when the line, or its owner's share of
        it, is full. Refuses the request it pushes out, if any."""
        try:
            elsewhere = None if self.fleet is None else self.fleet.held_by_owner(m.name)
            owner = None if key is None else key.owner
            w = self.room.join(m, route.session, now, owner, elsewhere)
        except Full as full:
            if full.owner is None:
                said = (
                    f"{self.room.per_model} requests already wait for {m.name}, the most "
                    f"one model may have waiting; it should be ready in about {retry_after}s"
                )
            else:
                said = (
                    f"the share of {full.owner} of the line for {m.name} is full: it has "
                    f"{full.held} of the {self.room.per_model} requests that may wait "
                    f"({full.share} a tenant while others wait); it should be ready in "
                    f"about {retry_after}s"
                )
            raise queue_full(said, retry_after) from None
        w.route = route
        if w.displaced is not None:
            self._displace(w.displaced, m, retry_after)
        return w

    async def _held(self, w: Waiter, resp: Stream | None, bound: float) -> None:
        """Wait up to `bound` seconds for `w` to be released; a held stream (`resp`) is
        sent a comment every `keepalive_s` meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound
        while not w.fut.done():
            left = deadline - loop.time()
            if left <= 0:
                return
            step = left if resp is None else min(left, self.settings.keepalive_s)
            await asyncio.wait((w.fut,), timeout=step)
            if not w.fut.done() and resp is not None and loop.time() < deadline:
                await resp.write(KEEPALIVE)

    def _too_long(self, m: catalog.Model, bound: float) -> Refusal:
        after = coldstart.outlook(self.view(), m, utc_now(), floor_s=0)
        said = (
            f"{m.name} was not ready within the {bound:.0f}s this request could wait; it "
            f"should be ready in about {after.retry_after}s"
        )
        return Refusal(
            429,
            said,
            "not_ready_in_time",
            kind="rate_limit_error",
            headers={"Retry-After": str(after.retry_after)},
            words=said,
        )

    def _left(self, w: Waiter) -> None:
        """`w` leaves without being sent (refused, or its client gone)."""
        self.room.leave(w)
        if w.fut.done() and not w.fut.cancelled() and w.fut.exception() is None:
            # Released to a replica as the client went away: its slot is free.
            self.done(w.fut.result(), w.route)
        elif not w.fut.done():
            w.fut.cancel()

    def _displace(self, w: Waiter, m: catalog.Model, retry_after: int) -> None:
        """`w` pushed out of a full line for a request of an owner under its share."""
        w.displaced = None
        if w.fut.done():
            return
        line = self.room.lines.get(m.name)
        share = self.room.per_model // max(1, len(line.queues) if line is not None else 1)
        said = (
            f"the share of {w.owner} of the line for {m.name} is full: {share} a tenant "
            f"while others wait, and another tenant's request took this one's place; it "
            f"should be ready in about {retry_after}s"
        )
        w.fut.set_exception(queue_full(said, retry_after))

    def done(self, r: Any, route: routing.Route | None = None) -> None:
        """A request (`route`) sent to `r` has ended: its slot frees, and the line of its
        model (if any waits) is served from it."""
        self.router.done(r.id, route)
        if not self.room.lines:
            return
        m = self.view().catalog.resolve(r.model)
        line = None if m is None else self.room.lines.get(m.name)
        if line is not None and len(line):
            self.serve(line)

    def serve(self, line: Line) -> None:
        """Release the head of `line` to replicas with room, in order, each counted in
        flight as it is released; a model no longer declared refuses its line (404)."""
        view = self.view()
        m = view.catalog.resolve(line.model)
        if m is None:
            self._refuse(
                line,
                Refusal(
                    404,
                    f"the model {line.model!r} was removed while the request waited",
                    "unknown_model",
                ),
            )
            return
        limit = routing.admit_limit(view, m, self.settings.inflight_factor)
        while len(line):
            w = line.head()
            if w.fut.done():
                line.pop()
                continue
            r = self.router.pick(view, m, w.route, avoid=w.avoid, limit=limit)
            if r is None:
                break
            line.pop()
            if line.woken_at is not None:
                w.woken_at, line.woken_at = line.woken_at, None
            w.seq = view.seq
            w.fut.set_result(r)

    def _refuse(self, line: Line, refusal: Refusal) -> None:
        while len(line):
            w = line.pop()
            if not w.fut.done():
                w.fut.set_exception(refusal)
        self.room.drop_if_idle(line)

    def on_fold(self, event: ev.Event) -> None:
        """After each event folded, with requests waiting: serve the lines a ready (or
        another change of who is routable) can serve, critical first, and refuse those of
        a model the plane has just said it cannot place."""
        if not self.room.lines:
            return
        if isinstance(event, ev.ReplicaStateEvent) and event.data.state == "ready":
            m = self.view().catalog.resolve(event.data.model)
            line = None if m is None else self.room.lines.get(m.name)
            if line is not None and len(line):
                line.woken_at = time.perf_counter()
        if isinstance(event, VERDICTS):
            self._verdict()
        elif isinstance(event, WAKES):
            for line in list(self.room.ordered()):
                self.serve(line)

    def _verdict(self) -> None:
        """Refuse the lines of models the plane cannot place now (and of those removed)."""
        view = self.view()
        now = utc_now()
        for line in list(self.room.ordered()):
            m = view.catalog.resolve(line.model)
            if m is None:
                self.serve(line)  # refuses it
                continue
            since = line.since
            cannot = (
                None
                if since is None or routing.candidates(view, m)
                else coldstart.unplaceable(view, m, now, since)
            )
            if cannot is not None:
                self._refuse(line, unplaceable(cannot))

    async def _demand(self, line: Line) -> None:
        """Publish `model.demanded` for `line` at once, then at most once every
        `demand_interval_s` while it has requests waiting; once it empties, one with
        `waiting` 0 says the wait is over, and the task ends (the next request to wait
        starts another, published at once as the first of its wait)."""
        began = line.since
        try:
            while not self.stopping:
                since = line.since or began
                if since is None:
                    # The line emptied (a stop sent its requests away) before this task
                    # first ran: nothing waited, nothing to say.
                    if not len(line):
                        return
                    since = utc_now()
                began = since
                waiting = len(line)
                await self._publish_demand(line, since, waiting)
                if not waiting:
                    if len(line):
                        continue  # a request came while the end was being said
                    return
                # The next report a second on, or the end as soon as the line empties.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(line.emptied.wait(), self.settings.demand_interval_s)
        finally:
            line.demand = None
            self.room.drop_if_idle(line)

    async def _publish_demand(self, line: Line, since: datetime, waiting: int) -> None:
        fleet = self.fleet
        if fleet is not None:
            # One report for the fleet's waiting requests, each counted once.
            if not fleet.reports(line.model, waiting):
                return
            waiting += fleet.waiting(line.model)
        view = self.view()
        m = view.catalog.resolve(line.model)
        inflight = 0
        if m is not None:
            got = self.router.inflight
            others = fleet.inflight() if fleet is not None else {}
            inflight = sum(
                got.get(r.id, 0) + others.get(r.id, 0) for r in routing.candidates(view, m)
            )
        e = ev.make(
            ev.ModelDemanded(
                model=line.model,
                waiting=min(waiting, ev.MAX_REPLICAS),
                since=since,
                inflight=min(inflight, ev.MAX_REPLICAS),
            ),
            id=new_id(),
            time=utc_now(),
            source=SOURCE,
        )
        try:
            await self.publisher.publish(e)
            self.counts.demanded += 1
            self.labelled.of(self.metrics.demanded, line.model).inc()
        except (BusError, nats.errors.Error) as err:
            self.lines.say(
                logging.WARNING,
                ("demand", line.model),
                "gateway: demand for %s not published: %s",
                line.model,
                err,
            )

    async def stop(self) -> None:
        """The held requests went with the server; their demand reports end too."""
        self.stopping = True
        demands = [line.demand for line in self.room.lines.values() if line.demand]
        for task in demands:
            task.cancel()
        for task in demands:
            with contextlib.suppress(asyncio.CancelledError):
                await task
