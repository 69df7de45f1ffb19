"""The gateway's waiting room: requests held for a model that cannot take them now.

Used by `services.gateway.holding`. A request for a declared model with no replica that
can take it (none routable: at zero or starting; or every routable one at its admission
limit) joins its model's line, up to `per_model` requests a model; past that it is
refused (429). A line is shared fairly among the owners of the keys that sent its
requests (a gateway without keys has one owner, None, and the line is FIFO): each owner
waits in its own queue, FIFO, and the line is released one request per owner in turn,
so a tenant that sent a thousand does not keep one that sent one waiting behind them.
A full line still takes a request of an owner holding less than its share (`per_model`
/ the owners waiting, itself included): the newest request of the owner holding the
most is pushed out for it (refused, 429, its owner named); an owner at its share is
refused itself. The server releases the head of a line when a replica can take it: on
the fold of the replica's ready (no polling), and as each request it sends ends, so a
replica just ready gets what its limit takes and the rest as it answers. A released
request is handed its replica, already counted in flight, so nothing overtakes it
between its release and its send. When several lines can be served at once, `ordered`
gives them by class: critical before standard before opportunistic.

It knows nothing of HTTP, of the log or of time beyond the arrival it is given; what a
request waits for and how long is the server's (`services.core.coldstart`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from services.core import catalog, routing

# PER_MODEL is how many requests one model may have waiting (`--queue-per-model`): a
# burst at a model at zero is held through its start up to this, and refused past it
# with when to come back, rather than held in numbers no start can serve in time.
PER_MODEL = 256


class Full(Exception):
    """A model's line is at its length, and the owner's share of it is full."""

    def __init__(self, model: str, owner: str | None = None, held: int = 0, share: int = 0):
        super().__init__(model)
        self.model = model
        self.owner = owner
        self.held = held
        """What the owner holds of the line."""
        self.share = share
        """What an owner may hold of it now (`per_model` / the owners waiting)."""


@dataclass(eq=False)
class Waiter:
    """One held request."""

    model: str
    session: str | None
    arrived: datetime
    fut: asyncio.Future[Any]
    owner: str | None = None
    """The owner of the key that sent it (None: no keys)."""
    """Done with the replica it was released to (counted in flight), or with the
    refusal it gets instead."""
    woken_at: float | None = None
    """perf_counter() when the ready that released it was folded, for the first request
    a ready released (the wake latency)."""
    seq: int = 0
    """The seq of the view it was released from (its answer's `x-llmgw-seq`)."""
    displaced: Waiter | None = None
    """The request pushed out of a full line to let it in (the server refuses it)."""
    route: routing.Route | None = None
    """What its replica is picked by (`services.core.routing`)."""
    avoid: tuple[str, ...] = ()
    """Replicas it may not be given: a continued stream's broken ones
    (`services.gateway.continuation`)."""


@dataclass(eq=False)
class Line:
    """One model's waiting requests: a queue per owner, FIFO, the owners in turn."""

    model: str
    rank: int
    """The model's class rank (catalog.class_rank): a higher one is served first."""
    queues: dict[str | None, deque[Waiter]] = field(default_factory=dict)
    """Per owner, its requests oldest first; the owners in the order of their turns."""
    count: int = 0
    demand: asyncio.Task[None] | None = None
    """The task publishing this line's demand while it has waiters."""
    woken_at: float | None = None
    """perf_counter() of the last ready of the model folded while it had waiters and not
    yet handed to the first request it released."""
    emptied: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when its last waiter leaves (released, refused or gone): its demand stops."""

    def __len__(self) -> int:
        return self.count

    def head(self) -> Waiter:
        """The next request to release: the oldest of the owner whose turn it is."""
        return self.queues[next(iter(self.queues))][0]

    def pop(self) -> Waiter:
        """The head of the line, taken out of it; its owner's turn goes to the end."""
        owner = next(iter(self.queues))
        q = self.queues.pop(owner)
        w = q.popleft()
        if q:
            self.queues[owner] = q
        self._took()
        return w

    def append(self, w: Waiter) -> None:
        self.queues.setdefault(w.owner, deque()).append(w)
        self.count += 1
        self.emptied.clear()

    def remove(self, w: Waiter) -> bool:
        """Take `w` out, wherever it is; whether it was in."""
        q = self.queues.get(w.owner)
        if q is None:
            return False
        try:
            q.remove(w)
        except ValueError:
            return False
        if not q:
            del self.queues[w.owner]
        self._took()
        return True

    def held_by(self, owner: str | None) -> int:
        return len(self.queues.get(owner, ()))

    def waiters(self) -> list[Waiter]:
        """Every request waiting, oldest first."""
        return sorted((w for q in self.queues.values() for w in q), key=lambda w: w.arrived)

    def _took(self) -> None:
        self.count -= 1
        if not self.count:
            self.emptied.set()

    @property
    def since(self) -> datetime | None:
        """When the longest-held request arrived; None with none."""
        return min((q[0].arrived for q in self.queues.values()), default=None)


class WaitingRoom:
    """Every model's line."""

    def __init__(self, per_model: int = PER_MODEL) -> None:
        self.per_model = per_model
        self.lines: dict[str, Line] = {}

    def held(self) -> int:
        """Requests held now, all models together."""
        return sum(len(line) for line in self.lines.values())

    def held_by_model(self) -> dict[str, int]:
        return {name: len(line) for name, line in self.lines.items() if len(line)}

    def held_by_owner(self) -> dict[str, dict[str, int]]:
        """Per model with requests held, per owner ("" for none) how many."""
        return {
            name: {o or "": len(q) for o, q in line.queues.items() if q}
            for name, line in self.lines.items()
            if len(line)
        }

    def waiting(self, model: str) -> int:
        line = self.lines.get(model)
        return 0 if line is None else len(line)

    def join(
        self,
        m: catalog.Model,
        session: str | None,
        arrived: datetime,
        owner: str | None = None,
        elsewhere: Mapping[str | None, int] | None = None,
    ) -> Waiter:
        """Hold a request of `m` sent by `owner` at the end of its owner's queue; `Full`
        at the line's length when the owner holds its share. A request let into a full
        line has the one pushed out for it as its `displaced` (the caller refuses it).
        `elsewhere`: what the other gateways hold of the model's line, per owner (the
        line, its length and its shares are then the fleet's; only a request held here
        can be pushed out, so with none here a request under its share is let in past
        the length until the others' lines move)."""
        line = self.lines.get(m.name)
        if line is None:
            line = self.lines[m.name] = Line(model=m.name, rank=catalog.class_rank(m.cls))
        line.rank = catalog.class_rank(m.cls)
        displaced = None
        others = {o: n for o, n in (elsewhere or {}).items() if n > 0}
        if len(line) + sum(others.values()) >= self.per_model:
            owners = len(line.queues.keys() | others.keys() | {owner})
            share = max(1, self.per_model // owners)
            held = line.held_by(owner) + others.get(owner, 0)
            if held >= share:
                raise Full(m.name, owner, held, share)
            if line.queues:
                # The owner holding the most (the latest to wait of those, on a tie)
                # gives up its newest request.
                most = max(
                    line.queues,
                    key=lambda o: (
                        len(line.queues[o]) + others.get(o, 0),
                        line.queues[o][-1].arrived,
                    ),
                )
                displaced = line.queues[most][-1]
                line.remove(displaced)
        w = Waiter(
            model=m.name,
            session=session,
            arrived=arrived,
            fut=asyncio.get_running_loop().create_future(),
            owner=owner,
            displaced=displaced,
        )
        line.append(w)
        return w

    def leave(self, w: Waiter) -> None:
        """Take `w` out of its line, if it is still in it."""
        line = self.lines.get(w.model)
        if line is None:
            return
        line.remove(w)
        self.drop_if_idle(line)

    def drop_if_idle(self, line: Line) -> None:
        """Forget a line with no waiter and no demand task."""
        if not len(line) and line.demand is None and self.lines.get(line.model) is line:
            del self.lines[line.model]

    def ordered(self) -> Iterator[Line]:
        """The lines with waiters, critical first, then by who has waited longest."""
        busy = [(line, line.since) for line in self.lines.values() if len(line)]
        busy.sort(key=lambda x: (-x[0].rank, x[1]))
        return iter(line for line, _ in busy)
