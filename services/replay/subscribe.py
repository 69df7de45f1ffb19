"""Follow the view as it changes, for dashboards: `subscribe(js, from_seq, root=...)`.

Called by the dashboard (and by anything else that wants a live view without running a
projector). It lists, then watches, as a Kubernetes informer does: it rebuilds the view
as it stood just before `from_seq` (from the newest snapshot at or before it, else from
zero), yields that once as a listing, then yields `(seq, Changes)` for every event from
`from_seq` on, for as long as the caller iterates. When `from_seq` is older than the
stream's first message the events in between are gone, and it raises `Relist` (the 410
Gone of an informer): the caller subscribes again with `from_seq=None` and takes the
listing as its new truth.

It must not publish, write, or decide: it folds with the one fold and reports.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import nats.errors

from schemas import subjects
from schemas.events import Event, type_of
from services.bus import follow
from services.bus.errors import LogHole
from services.core import ingest
from services.core.ingest import Ingest
from services.core.view import View
from services.replay import ports, rebuild, render
from services.replay.errors import Relist, ReplayError
from services.replay.source import StreamSource

# LIST is the `type` of the first yield: the whole view, every entity in `keys`.
LIST = "list"
UNDECODABLE = "undecodable"

# QUEUE_BATCHES bounds the batches read ahead of the caller. A slow dashboard then slows
# the reader's hand-off, never nats-py's own callback (which must not wait, or the client
# drops messages; see services.bus.consume).
QUEUE_BATCHES = 8


@dataclass(frozen=True, slots=True)
class Changes:
    """What one event changed. `view` is the live view after it: read it before the next
    iteration (it goes on changing), or take `view.copy()`."""

    type: str
    """The event's type; `list` for the initial listing; `undecodable` for a message the
    projector dead-letters (it does not decode, or does not belong on its subject)."""
    keys: frozenset[str]
    """The entities touched, as `replica/r-7`, `model/llama-70b`, `node/gpu-a1`, `quota`."""
    view: View
    rejected: str | None = None
    """Why the fold rejected the event, or why the message is a dead letter (the view did
    not change); None when applied."""
    event: Event | None = None

    def entities(self) -> dict[str, Any]:
        """Each touched entity as it is now, in JSON form; None for one that is gone."""
        return {k: entity_json(self.view, k) for k in sorted(self.keys)}


def entity_json(view: View, key: str) -> Any:
    kind, _, name = key.partition("/")
    s = view.state
    if kind == "replica":
        r = s.replicas.get(name)
        return None if r is None else render.replica_json(r, s.time)
    if kind == "model":
        d = s.models.get(name)
        live = view.live_for(name)
        if d is None and not live:
            return None
        return {
            "declared": d is not None,
            "class": None if d is None else d.cls,
            "desired": view.desired_for(name),
            "live": live,
            "held_for": s.holds[name].for_model if name in s.holds else None,
        }
    if kind == "node":
        n = s.nodes.get(name)
        if n is None:
            return None
        return {"cordoned": n.cordoned, "lost": n.lost, "gpus": len(n.report.gpus)}
    if kind == "quota":
        return [o.name for o in s.quota]
    return None


def all_keys(view: View) -> frozenset[str]:
    s = view.state
    out = {f"replica/{r}" for r in s.replicas}
    out |= {f"model/{m}" for m in s.models}
    out |= {f"node/{n}" for n in s.nodes}
    if s.quota:
        out.add("quota")
    return frozenset(out)


async def _listed(js: Any, from_seq: int | None, stream: str) -> tuple[int, View]:
    """The seq listed and the view as of `from_seq - 1` (None: the end of the stream now; past the end: the
    end), from the latest snapshot at or before it and the log after; `Relist` when the
    log no longer holds what it needs."""
    info = await js.stream_info(stream)
    first, last = info.state.first_seq or 1, info.state.last_seq
    if from_seq is not None and from_seq < 1:
        raise ValueError(f"from_seq starts at 1, got {from_seq}")
    if from_seq is not None and from_seq < first:
        raise Relist(from_seq, first)
    # A from_seq past the end starts at the end: there is nothing between to list.
    target = last if from_seq is None else min(from_seq - 1, last)
    view = await ports.snapshot_at_or_before(js, target)
    if view is not None and view.state.seq > target:
        view = None
    base = 0 if view is None else view.state.seq
    if base + 1 < first:
        # Invariant: a view is the fold of the log from its start; a log whose head was
        # purged can only be listed from a snapshot taken after the purge point.
        raise Relist(
            from_seq or first,
            first,
            f"the log before seq {first} is gone and no snapshot covers it: "
            "the view cannot be rebuilt here",
        )
    if view is None:
        view = View()
    if target > base:
        await rebuild.run(StreamSource(js, from_seq=base + 1, until_seq=target), view=view)
    view.state.seq = max(view.state.seq, target)
    return target, view


async def subscribe(
    js: Any,
    from_seq: int | None,
    *,
    root: str = subjects.DEFAULT_ROOT,
    stream: str = subjects.STREAM,
) -> AsyncIterator[tuple[int, Changes]]:
    """The listing as of `from_seq - 1` (None: the end of the stream now), then every
    event from there on. Raises `Relist` if `from_seq` is older than the stream's first
    message, or if the tail finds a message deleted from the log."""
    target, view = await _listed(js, from_seq, stream)
    yield view.state.seq, Changes(LIST, all_keys(view), view)

    queue: asyncio.Queue[list[Any] | BaseException] = asyncio.Queue(QUEUE_BATCHES)
    stop = asyncio.Event()
    read = target

    async def on_batch(batch: list[Any]) -> None:
        nonlocal read
        await queue.put(batch)
        read = batch[-1].seq

    async def pump() -> None:
        try:
            stopped = await follow.follow(
                js,
                position=lambda: read,
                on_batch=on_batch,
                stop=stop,
                name="subscribe",
                stream=stream,
            )
        except BaseException as e:
            await queue.put(e)
            raise
        if not stopped:
            await queue.put(nats.errors.ConnectionClosedError())

    # The tail is the projector's step: decoded, checked against its subject and folded
    # by `ingest`, so a dashboard sees the projector's dead letters and rejections.
    step = Ingest(view, root, keep_about=True)
    task = asyncio.create_task(pump())
    try:
        while True:
            got = await queue.get()
            if isinstance(got, LogHole):
                raise Relist(got.seq, got.seq + 1, f"the tail lost messages: {got}") from got
            if isinstance(got, BaseException):
                raise ReplayError(f"following the stream failed: {got}") from got
            for d in got:
                event = step.raw(d.seq, d.subject, d.data, d.time_ns)
                why = None if step.verdict is None else step.verdict.reason
                if event is None:
                    yield d.seq, Changes(UNDECODABLE, frozenset(), view, rejected=why)
                    continue
                keys = frozenset(ingest.label(k) for k in step.keys)
                yield d.seq, Changes(type_of(type(event)), keys, view, rejected=why, event=event)
    finally:
        stop.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
