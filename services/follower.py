"""ViewFollower: an in-memory View kept current from the log.

Used by the scheduler and the preemption service (and anything else that decides on
the view): it starts from a View (or the newest snapshot), reads on with the bus's
ordered reader, decodes, dead-letters what does not decode, folds with `fold.apply`,
and tracks the last sequence folded. `wait_for(seq)` lets a service refuse to decide on
a view older than the event it reacts to.

It never writes the view anywhere and never folds past a gap: a missing sequence means
the read is restarted from the last one folded (the view is exactly the log up to
there), and a message deleted from the stream stops it with `LogHole`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import nats.errors
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from schemas import events as ev
from schemas import subjects
from services.bus import consume
from services.bus.errors import SequenceGap
from services.core.view import Rejection, View
from services.projector import snapshots
from services.projector.errors import LogHole
from services.projector.folder import Folder, Gap

log = logging.getLogger("llmgw.follower")

OnChange = Callable[[int, ev.Event, Rejection | None], None]

# GAP_RETRIES is how often the same missing sequence is re-read before the stream is
# asked whether the message still exists. A gap from a lost delivery heals on re-read;
# one from a deleted message never does.
GAP_RETRIES = 3

# RETRY_PAUSE_S is the wait before reading again after the broker went away.
RETRY_PAUSE_S = 0.5


async def message_exists(js: JetStreamContext, seq: int, stream: str = subjects.STREAM) -> bool:
    """Whether the stream still holds message `seq` (False once deleted)."""
    try:
        await js.get_msg(stream, seq)
    except NotFoundError:
        return False
    return True


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
        self._folder = Folder(view, root)
        self._advanced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.dead = 0
        """Messages that did not decode or did not belong on their subject."""
        self.gaps = 0
        """Gaps seen (each one a restart of the read from `seq`)."""
        self.error: BaseException | None = None
        """What stopped the follower, if it stopped on its own."""

    @property
    def view(self) -> View:
        return self._folder.view

    @property
    def seq(self) -> int:
        return self._folder.view.state.seq

    async def load_snapshot(self, seq: int | None = None) -> bool:
        """Start from the newest snapshot (at or before `seq`) if it is ahead of the view."""
        if self._task is not None:
            raise RuntimeError("load_snapshot before start")
        state = await snapshots.latest_at_or_before(self.js, seq)
        if state is None or state.seq <= self.seq:
            return False
        self._folder = Folder(View(state), self.root)
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
        same_gap = 0
        last_gap = -1
        try:
            while not stop.is_set():
                try:
                    await consume.read_ordered(
                        self.js,
                        from_seq=self.seq + 1,
                        on_batch=self._on_batch,
                        stop=stop,
                        stream=self.stream,
                    )
                except (SequenceGap, Gap) as e:
                    expected = self.seq + 1
                    self.gaps += 1
                    missing = e.expected
                    same_gap = same_gap + 1 if missing == last_gap else 1
                    last_gap = missing
                    log.warning(
                        "follower %s: %s; reading again from %d", self.consumer, e, expected
                    )
                    if same_gap >= GAP_RETRIES and not await message_exists(
                        self.js, missing, self.stream
                    ):
                        raise LogHole(missing, self.stream) from e
                except nats.errors.ConnectionClosedError:
                    return
                except (nats.errors.Error, TimeoutError) as e:
                    # The broker went away or restarted: read again from where we are.
                    log.warning("follower %s: read failed (%s); retrying", self.consumer, e)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), RETRY_PAUSE_S)
        except BaseException as e:
            self.error = e
            self._notify()
            raise
        finally:
            self._notify()

    async def _on_batch(self, batch: list[consume.Delivery]) -> None:
        folder = self._folder
        on_change = self.on_change
        fold_raw = folder.fold_raw
        rejections = folder.dirty.rejections
        try:
            for d in batch:
                n_rej = len(rejections)
                event = fold_raw(d.seq, d.subject, d.data)
                if on_change is not None and event is not None:
                    rej = rejections[-1] if len(rejections) > n_rej else None
                    on_change(d.seq, event, rej)
        finally:
            dead = folder.dirty.dead
            self.dead += len(dead)
            folder.dirty.clear()
            self._notify()
        await consume.dead_letters(self.js, self.root, self.consumer, dead)
