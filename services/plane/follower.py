"""ViewFollower: an in-memory View kept current from the log.

Used by the scheduler and the preemption service (and anything else that decides on
the view): it starts from a View (or the newest snapshot), reads on with the bus's
follow loop (`services.bus.follow`), ingests each message as the projector does
(`services.core.ingest`: decode, subject check, fold), dead-letters what does not
decode or does not belong on its subject, and tracks the last sequence folded. `wait_for(seq)` lets a service refuse to decide on
a view older than the event it reacts to.

It never writes the view anywhere and never folds past a gap: a missing sequence means
the read is restarted from the last one folded (the view is exactly the log up to
there), and a message deleted from the stream stops it with `LogHole`. A stream
replaced under it (deleted and created again) is another log: the view is rebuilt
from that log's start, with one line saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import nats.errors
from nats.js.client import JetStreamContext

from schemas import events as ev
from schemas import subjects
from services.bus import consume, follow, snapshots
from services.bus.errors import BusError, SequenceGap, StreamReplaced
from services.core.ingest import Gap, Ingest
from services.core.view import Rejection, View

log = logging.getLogger("llmgw.follower")

OnChange = Callable[[int, ev.Event, Rejection | None], None]


class ViewFollower:
    """Keeps `view` equal to the fold of the log up to `seq`.

    `on_change(seq, event, rejection)` is called (synchronously, in log order) for every
    event folded; keep it quick, or hand the work to a queue of your own.
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        view: View | None = None,
        root: str = subjects.DEFAULT_ROOT,
        consumer: str = "follower",
        on_change: OnChange | None = None,
        stream: str = subjects.STREAM,
    ) -> None:
        self.js = js
        self.root = root
        self.consumer = consumer
        self.on_change = on_change
        self.stream = stream
        self._folder = Ingest(view, root)
        self._advanced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.dead = 0
        """Messages that did not decode or did not belong on their subject."""
        self.gaps = 0
        """Gaps seen (each one a restart of the read from `seq`)."""
        self.replaced = 0
        """Times the stream was found replaced, and the view rebuilt from the new log."""
        self.error: BaseException | None = None
        """What stopped the follower, if it stopped on its own."""

    @property
    def view(self) -> View:
        return self._folder.view

    @property
    def seq(self) -> int:
        return self._folder.view.state.seq

    async def load_snapshot(self, seq: int | None = None) -> bool:
        """Start from the newest snapshot (at or before `seq`) if it is ahead of the view.
        A snapshot only spares reading the log: one that cannot be read now (the broker
        restarting, an election) is said in one line, and the log is read from the view's
        position instead, rather than stopping whoever follows."""
        if self._task is not None:
            raise RuntimeError("load_snapshot before start")
        try:
            state = await snapshots.latest_at_or_before(self.js, seq)
        except (nats.errors.Error, BusError, TimeoutError) as e:
            log.warning(
                "follower %s: no snapshot read (%s: %s); reading the log from seq %d",
                self.consumer,
                type(e).__name__,
                e,
                self.seq + 1,
            )
            return False
        if state is None or state.seq <= self.seq:
            return False
        self._folder = Ingest(View(state), self.root)
        return True

    def start(self) -> asyncio.Task[None]:
        """Follow in a background task until `stop()`."""
        if self._task is None:
            self._task = asyncio.create_task(self.run(self._stop), name=f"follow-{self.consumer}")
        return self._task

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait_for(self, seq: int, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Return once the view has folded at least `seq`; `TimeoutError` after `timeout`.

        Raises the follower's error if it stopped for good (a hole in the log).
        """
        async with asyncio.timeout(timeout):
            while self.seq < seq:
                if self.error is not None:
                    raise self.error
                if self._task is not None and self._task.done():
                    raise RuntimeError(f"follower {self.consumer} stopped at {self.seq}")
                await self._advanced.wait()

    async def caught_up(self, timeout: float | None = None) -> int:  # noqa: ASYNC109
        """Wait until the view has folded the stream's last message as of now."""
        info = await self.js.stream_info(self.stream)
        await self.wait_for(info.state.last_seq, timeout)
        return self.seq

    def _notify(self) -> None:
        self._advanced.set()
        self._advanced = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow until `stop` is set. Returns on stop; raises `LogHole` for a deleted
        message (after setting `error`, so waiters hear of it)."""

        def restart(e: BaseException) -> None:
            if isinstance(e, SequenceGap | Gap):
                self.gaps += 1

        try:
            while True:
                try:
                    await follow.follow(
                        self.js,
                        position=lambda: self._folder.seq,
                        on_batch=self._on_batch,
                        stop=stop,
                        restart=restart,
                        name=f"follower {self.consumer}",
                        stream=self.stream,
                    )
                    break
                except StreamReplaced as e:
                    # Another log now: the view of the old one says nothing about it.
                    # Start again from nothing and fold the new log from its start, as
                    # the projector does; whoever decides on the view waits for it as
                    # for any view behind the log.
                    log.error(
                        "follower %s: %s; rebuilding the view from the new log", self.consumer, e
                    )
                    self.replaced += 1
                    self._folder = Ingest(None, self.root)
                    self._notify()
        except BaseException as e:
            self.error = e  # set before the waiters are woken (finally), so they see it
            raise
        finally:
            self._notify()

    async def _on_batch(self, batch: list[consume.Delivery]) -> None:
        step = self._folder
        on_change = self.on_change
        raw = step.raw
        try:
            if on_change is None:
                for d in batch:
                    raw(d.seq, d.subject, d.data, d.time_ns)
            else:
                for d in batch:
                    event = raw(d.seq, d.subject, d.data, d.time_ns)
                    if event is not None:
                        on_change(d.seq, event, step.verdict)  # type: ignore[arg-type]
        finally:
            dead = step.touched.dead
            self.dead += len(dead)
            step.touched.clear()
            self._notify()
            # Even when a gap cut the batch short: the view is past these messages, and
            # no re-read will hand them on again.
            await consume.dead_letters(self.js, self.root, self.consumer, dead)
