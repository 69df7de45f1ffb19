"""What a service that acts only while it leads shares: the scheduler's and the
preemption service's leader skeleton.

Used by `services.scheduler.service` and `services.preemption.service`. A `Leader` holds
the service's holder name, its `ViewFollower`, its `Lease`, the sequence of its own last
publish (no decision is taken on a view short of it) and the one way it publishes:
in order, pipelined, in batches, each begun only with enough lease left.

The life cycle is one for both services: `run(stop, *work)` follows the log, takes part
in the lease and runs the service's own loops; on `stop` the belief ends first, the
loops stop, and only then is the lease released on the server, so a standby takes over
at once and never while this process still publishes. A cancelled run (a crash, as far
as the others can tell) releases nothing: the standby takes over when the TTL runs out.

It says where it stands, once each time that changes: a line when it stands by, naming
the holder of the lease, and a line when it takes over from standing by.

It decides nothing itself, and never publishes while it does not hold the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import nats.errors
from nats.js.client import JetStreamContext

from schemas import codec, subjects
from schemas import events as ev
from services.bus import Published, Publisher, tracing
from services.plane.follower import OnChange, ViewFollower
from services.plane.lease import Lease

log = logging.getLogger("llmgw.leader")

# BATCH bounds the events published between two looks at the lease. A pass that places
# a thousand replicas must not run on after a lapse; at ~10k events/s a batch takes
# a few tens of milliseconds, well inside the lease's safety margin.
BATCH = 256

# MIN_LEASE_LEFT_S is the least lease time a batch starts with: a batch begun with less
# could still be publishing when the belief ends.
MIN_LEASE_LEFT_S = 0.05

Outgoing = tuple[ev.Event, str | None]
"""An event to publish, and the node whose command subject it goes on (commands only)."""

Work = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


class LeaseLapsed(Exception):
    """The lease ran short before a batch: `published` holds the acks of what went out
    before it, in order; the rest was not sent."""

    def __init__(self, published: list[Published], left: int) -> None:
        super().__init__(f"lease lapsed; {left} event(s) not published")
        self.published = published
        self.left = left


def default_holder(tag: object) -> str:
    """A holder name unique to this process and object: host, pid and `tag`'s id."""
    return f"{socket.gethostname()}-{os.getpid()}-{id(tag):x}"


class Leader:
    """One service's part in a leader election, and its view and publishing."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        role: str,
        root: str = subjects.DEFAULT_ROOT,
        holder: str | None = None,
        ttl_s: float = 5.0,
        follower: ViewFollower | None = None,
        consumer: str | None = None,
        on_event: OnChange | None = None,
        on_lease: Callable[[bool], None] | None = None,
    ) -> None:
        """`role` names the lease (`<root>.<role>`) and, unless `consumer` does, the
        follower's consumer; `on_event` is the follower's on_change."""
        self.js = js
        self.root = root
        self.role = role
        self.holder = holder or default_holder(self)
        self.follower = (
            follower
            if follower is not None
            else ViewFollower(js, root=root, consumer=consumer or role, on_change=on_event)
        )
        self.publisher = Publisher(js, root)
        self.lease = Lease(
            js, name=f"{root}.{role}", holder=self.holder, ttl_s=ttl_s, on_change=self._on_lease
        )
        self._on_lease_cb = on_lease
        self.leading = asyncio.Event()
        """Set while the lease is held."""
        self.deposed = asyncio.Event()
        """Set while it is not, once it was."""
        # written is the stream sequence of this process's last publish. A decision is
        # taken on a view at least this far along: without it a second trigger already
        # in the stream before our first decision would be decided on a view that does
        # not hold that decision.
        self.written = 0
        self._written_in = 0
        # standing_by_for is the holder this process last said it stands by for; None
        # while it leads or has not said so yet.
        self.standing_by_for: str | None = None

    @property
    def is_leader(self) -> bool:
        return self.lease.is_leader

    async def run(self, stop: asyncio.Event, *work: Work) -> None:
        """Follow the log, take part in the lease and run `work` until `stop`; the first
        to fail takes the rest down with it. See the module docstring for the stop."""
        tasks = [
            asyncio.create_task(self.follower.run(stop), name=f"{self.lease.name}.follow"),
            asyncio.create_task(self.lease.run(stop, release=False), name=self.lease.name),
            asyncio.create_task(self._say_standing_by(stop), name=f"{self.lease.name}.standby"),
            *(asyncio.create_task(w(stop)) for w in work),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if not t.cancelled() and (e := t.exception()) is not None:
                    raise e
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.lease.release()

    async def _say_standing_by(self, stop: asyncio.Event) -> None:
        """While not leading, look at who holds the lease once a renewal period, and say
        so once for each holder. Without it a standby is silent, and an operator cannot
        tell a standby from a process that is stuck."""
        while not stop.is_set():
            if not self.lease.is_leader:
                other: str | None = None
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    other = await self.lease.current_holder()
                if (
                    other is not None
                    and other not in (self.holder, self.standing_by_for)
                    and not self.lease.is_leader
                ):
                    self.standing_by_for = other
                    log.info(
                        "%s %s: standing by; %s holds the lease %s",
                        self.role,
                        self.holder,
                        other,
                        self.lease.name,
                    )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.lease.renew_every_s)

    def _on_lease(self, leading: bool) -> None:
        if leading:
            if self.standing_by_for is not None:
                log.info(
                    "%s %s: taking over the lease %s from %s",
                    self.role,
                    self.holder,
                    self.lease.name,
                    self.standing_by_for,
                )
            self.standing_by_for = None
            self.deposed.clear()
            self.leading.set()
        else:
            self.leading.clear()
            self.deposed.set()
        if self._on_lease_cb is not None:
            self._on_lease_cb(leading)

    async def caught_up(self, seq: int, timeout: float) -> None:  # noqa: ASYNC109
        """Return once the view holds `seq` and this process's own last publish."""
        await self.follower.wait_for(max(seq, self.own_last()), timeout)

    def own_last(self) -> int:
        """The sequence of this process's last publish in the log the view follows: 0
        once the stream was replaced since (that publish was in the old log, whose
        sequences the new one may not reach for a long while)."""
        if self._written_in != self.follower.replaced:
            self.written, self._written_in = 0, self.follower.replaced
        return self.written

    async def last_seq(self) -> int:
        """The stream's last sequence, as the server says now."""
        info = await self.js.stream_info(subjects.STREAM)
        return int(info.state.last_seq)

    def _parent(self, e: ev.Event) -> Any:
        model = getattr(e.data, "model", None)
        latest = (
            (subjects.scale_subject(model, self.root), subjects.model_subject(model, self.root))
            if isinstance(model, str)
            else ()
        )
        return tracing.recalled(e.causation, *latest)

    async def publish(self, items: Sequence[Outgoing], *, batch: int = BATCH) -> list[Published]:
        """Publish in order, pipelined, `batch` at a time, and wait for every ack.

        Each batch starts only with at least MIN_LEASE_LEFT_S of lease left, else
        `LeaseLapsed`. On one connection the stream stores them in the order given, so a
        crash part way leaves a prefix stored.
        """
        out: list[Published] = []
        for i in range(0, len(items), batch):
            if self.lease.remaining_s() < MIN_LEASE_LEFT_S:
                raise LeaseLapsed(out, len(items) - i)
            # A publish that meets an election is retried, but never started again past
            # the lease: a standby may lead by then, and its decisions are the ones to keep.
            self.publisher.retry_s = self.lease.remaining_s()
            raw = [
                (subjects.subject_for(e, self.root, node), codec.encode(e), e.id)
                for e, node in items[i : i + batch]
            ]
            parent_of = None
            if tracing.enabled():
                # Each reaction joins the trace of what it reacts to: its cause, else the
                # latest word on its model (a placement answers the model's scale).
                now = items[i : i + batch]
                parent_of = lambda j, now=now: self._parent(now[j][0])  # noqa: E731
            acks = await self.publisher.publish_many(raw, parent_of=parent_of)
            self.written = max(self.own_last(), *(a.seq for a in acks))
            out += acks
        return out
