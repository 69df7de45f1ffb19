"""The gateway's waiting room: requests held for a model that cannot take them now.

Used by `services.gateway.server`. A request for a declared model with no replica that
can take it (none routable: at zero or starting; or every routable one at its admission
limit) joins its model's line, FIFO, up to `per_model` requests a model; past that it is
refused (429). The server releases the head of a line when a replica can take it: on
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
import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from services.core import catalog

# PER_MODEL is how many requests one model may have waiting (`--queue-per-model`): a
# burst at a model at zero is held through its start up to this, and refused past it
# with when to come back, rather than held in numbers no start can serve in time.
PER_MODEL = 256


class Full(Exception):
    """A model's line is at its length."""


@dataclass(eq=False)
class Waiter:
    """One held request."""

    model: str
    session: str | None
    arrived: datetime
    fut: asyncio.Future[Any]
    """Done with the replica it was released to (counted in flight), or with the
    refusal it gets instead."""
    woken_at: float | None = None
    """perf_counter() when the ready that released it was folded, for the first request
    a ready released (the wake latency)."""
    seq: int = 0
    """The seq of the view it was released from (its answer's `x-llmgw-seq`)."""


@dataclass(eq=False)
class Line:
    """One model's waiting requests, oldest first."""

    model: str
    rank: int
    """The model's class rank (catalog.class_rank): a higher one is served first."""
    waiters: deque[Waiter] = field(default_factory=deque)
    demand: asyncio.Task[None] | None = None
    """The task publishing this line's demand while it has waiters."""
    woken_at: float | None = None
    """perf_counter() of the last ready of the model folded while it had waiters and not
    yet handed to the first request it released."""
    emptied: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when its last waiter leaves (released, refused or gone): its demand stops."""

    def __len__(self) -> int:
        return len(self.waiters)

    def pop(self) -> Waiter:
        """The head of the line, taken out of it."""
        w = self.waiters.popleft()
        if not self.waiters:
            self.emptied.set()
        return w

    @property
    def since(self) -> datetime | None:
        """When the longest-held request arrived; None with none."""
        return self.waiters[0].arrived if self.waiters else None


class WaitingRoom:
    """Every model's line."""

    def __init__(self, per_model: int = PER_MODEL) -> None:
        self.per_model = per_model
        self.lines: dict[str, Line] = {}

    def held(self) -> int:
        """Requests held now, all models together."""
        return sum(len(line) for line in self.lines.values())

    def held_by_model(self) -> dict[str, int]:
        return {name: len(line) for name, line in self.lines.items() if line.waiters}

    def waiting(self, model: str) -> int:
        line = self.lines.get(model)
        return 0 if line is None else len(line)

    def join(self, m: catalog.Model, session: str | None, arrived: datetime) -> Waiter:
        """Hold a request of `m` at the end of its line; `Full` at its length."""
        line = self.lines.get(m.name)
        if line is None:
            line = self.lines[m.name] = Line(model=m.name, rank=catalog.class_rank(m.cls))
        line.rank = catalog.class_rank(m.cls)
        if len(line) >= self.per_model:
            raise Full(m.name)
        w = Waiter(
            model=m.name,
            session=session,
            arrived=arrived,
            fut=asyncio.get_running_loop().create_future(),
        )
        line.waiters.append(w)
        line.emptied.clear()
        return w

    def leave(self, w: Waiter) -> None:
        """Take `w` out of its line, if it is still in it."""
        line = self.lines.get(w.model)
        if line is None:
            return
        with contextlib.suppress(ValueError):
            line.waiters.remove(w)
        if not line.waiters:
            line.emptied.set()
        self.drop_if_idle(line)

    def drop_if_idle(self, line: Line) -> None:
        """Forget a line with no waiter and no demand task."""
        if not line.waiters and line.demand is None and self.lines.get(line.model) is line:
            del self.lines[line.model]

    def ordered(self) -> Iterator[Line]:
        """The lines with waiters, critical first, then by who has waited longest."""
        busy = [line for line in self.lines.values() if line.waiters]
        busy.sort(key=lambda line: (-line.rank, line.waiters[0].arrived))
        return iter(busy)
