"""The dashboard's one subscription to the log, fanned out to every client.

Called by the dashboard's server: `Hub.run(stop)` follows the log with
`services.replay.subscribe` (list, then watch) for the whole process, keeps the live view,
encodes each event once as a Server-Sent Events frame, keeps the last `keep` frames for
clients that resume (`Last-Event-ID`), and hands each batch of frames to every client's
bounded queue. A client whose queue is full is told to re-list and dropped, never let to
grow memory; a client that asks for a position older than what is kept is told the same
(the 410 Gone of a Kubernetes watch). When the log itself cannot be followed on (the
stream was replaced, the connection closed, a hole) the hub lists again, and every client
is told to re-list.

It must not publish or write anything: the dashboard is read-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from schemas import subjects
from services.core.view import View
from services.dashboard import state
from services.replay import subscribe
from services.replay.subscribe import Changes

log = logging.getLogger("llmgw.dashboard")

# KEEP is how many recent frames the hub keeps for clients that resume: at 1,000 events
# a second, ten seconds of reconnecting. Past it a client re-lists, which costs one view.
KEEP = 10_000
# CLIENT_FRAMES bounds the frames waiting for one client. A client this far behind is
# told to re-list: a dashboard that cannot keep up is better redrawn than left to grow
# the server's memory with frames it will read too late to matter.
CLIENT_FRAMES = 4_000
# SUMMARY_S is how often the quota and decision summary is sent, when it changed: it
# follows from many events at once, and recomputing it per event would cost more than
# the events.
SUMMARY_S = 1.0
# RECENT is how many of the latest changes a listing carries for the page's feed; a hub
# that starts lists this far back, so a page opened after an incident still shows it.
RECENT = 200
# RETRY_S is the wait before listing again after the log could not be followed.
RETRY_S = 1.0
# CANCEL_AGAIN_S: how long a stopping hub waits for its follower to end before it
# cancels it again (see `run`).
CANCEL_AGAIN_S = 0.5
# PING_S is how often an idle stream gets a comment, so proxies keep it open.
PING_S = 15.0


def frame(event: str, data: Any, seq: int | None = None) -> bytes:
    head = f"id: {seq}\n" if seq is not None else ""
    # Invariant: one line of JSON (msgspec escapes newlines in strings), as SSE's
    # `data:` needs.
    return b"%sevent: %s\ndata: %s\n\n" % (head.encode(), event.encode(), _json(data))


_json = msgspec.json.Encoder().encode


class Client:
    """One SSE stream's queue: frames waiting, up to `cap`; `gone` says why it ended."""

    __slots__ = ("cap", "count", "frames", "gone", "skip_to", "wake")

    def __init__(self, cap: int, skip_to: int = 0) -> None:
        self.cap = cap
        self.frames: deque[bytes] = deque()
        self.count = 0
        self.gone: str | None = None
        self.wake = asyncio.Event()
        self.skip_to = skip_to
        """Frames of sequences below this are not wanted (a resume past the head)."""

    def push(self, chunk: bytes, n: int = 1) -> None:
        if self.gone is not None:
            return
        if self.count + n > self.cap:
            # Invariant: a client's queue never holds more than `cap` frames.
            self.frames.clear()
            self.count = 0
            self.end(f"the client fell more than {self.cap} events behind; re-list")
            return
        self.frames.append(chunk)
        self.count += n
        self.wake.set()

    def end(self, why: str) -> None:
        if self.gone is None:
            self.gone = why
        self.wake.set()

    async def take(self, idle_s: float) -> bytes | None:
        """The frames waiting, joined; b"" after `idle_s` with none; None once gone."""
        if not self.frames and self.gone is None:
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), idle_s)
        if self.frames:
            out = b"".join(self.frames)
            self.frames.clear()
            self.count = 0
            return out
        return None if self.gone is not None else b""


class Hub:
    """The live view and its subscribers."""

    def __init__(
        self,
        js: Any,
        *,
        root: str = subjects.DEFAULT_ROOT,
        keep: int = KEEP,
        client_frames: int = CLIENT_FRAMES,
        on_change: Callable[[int, Changes], None] | None = None,
        traffic: Callable[[], Any] | None = None,
    ) -> None:
        self.js = js
        self.root = root
        self.keep = keep
        self.client_frames = client_frames
        self.on_change = on_change
        # traffic: the requests a second and in flight per model (dashboard.traffic),
        # asked every SUMMARY_S and sent as a `traffic` frame when it changed; every
        # client gets the latest after its listing.
        self.traffic = traffic
        self._traffic: bytes = b""
        self._traffic_doc: Any = None
        self.view: View | None = None
        self.seq = 0
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=keep)
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.clients: set[Client] = set()
        self.listed = asyncio.Event()
        self.relisted = 0
        self.listings = 0
        """How many times the log was listed: a new listing may be another log."""
        """How many clients were told to re-list because they fell behind."""
        self._pending: list[tuple[int, bytes]] = []
        self._flush_at: asyncio.Handle | None = None
        self._listing: tuple[int, bytes] | None = None
        self._summary: bytes = b""
        self._dirty = False

    # ------------------------------------------------------------ following the log

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the log until `stop`; list again whenever it cannot be followed on."""
        ticker = asyncio.create_task(self._summaries(stop), name="dashboard: summary")
        said = ""
        try:
            while not stop.is_set():
                follow = asyncio.create_task(self._follow(), name="dashboard: follow")
                stopped = asyncio.create_task(stop.wait())
                await asyncio.wait([follow, stopped], return_when=asyncio.FIRST_COMPLETED)
                stopped.cancel()
                if not follow.done():
                    # A cancellation can be lost inside the NATS client (nats-py passes
                    # over a CancelledError in places), leaving the follower waiting on
                    # the tail for good: ask again until the task has ended.
                    while not follow.done():
                        follow.cancel()
                        await asyncio.wait([follow], timeout=CANCEL_AGAIN_S)
                    with contextlib.suppress(asyncio.CancelledError):
                        await follow
                    break
                why = str(follow.exception() or "the connection closed")
                if why != said:
                    # Said once per cause: a broker with no log yet is retried quietly.
                    log.warning("dashboard: following the log stopped (%s); listing again", why)
                    said = why
                self._reset("the log was listed again")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), RETRY_S)
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            self._reset("the dashboard is stopping")

    async def _follow(self) -> None:
        info = await self.js.stream_info(subjects.STREAM)
        st = info.state
        start = max(st.first_seq or 1, st.last_seq - RECENT + 1, 1)
        async for seq, ch in subscribe.subscribe(self.js, start, root=self.root):
            if ch.type == subscribe.LIST:
                self.view, self.seq = ch.view, seq
                self.listings += 1
                self.ring.clear()
                self.recent.clear()
                self._listing = None
                self._dirty = True
                self.listed.set()
                continue
            self.seq = seq
            self._listing = None
            self._dirty = True
            if self.on_change is not None:
                self.on_change(seq, ch)
            doc = state.change_doc(seq, ch, self.root)
            self.recent.append(doc)
            data = frame("change", doc, seq)
            self.ring.append((seq, data))
            self._pending.append((seq, data))
            if self._flush_at is None:
                # Every event of a batch folds before the loop runs anything else: one
                # hand-off per batch, not one per event per client.
                self._flush_at = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        frames, self._pending = self._pending, []
        if not frames:
            return
        first = frames[0][0]
        chunk = b"".join(d for _, d in frames)
        for c in self.clients:
            if c.skip_to <= first:
                c.push(chunk, len(frames))
            else:
                wanted = [d for s, d in frames if s >= c.skip_to]
                if wanted:
                    c.push(b"".join(wanted), len(wanted))

    def _reset(self, why: str) -> None:
        self.listed.clear()
        self.view = None
        self.ring.clear()
        self.recent.clear()
        self._pending = []
        self._listing = None
        for c in list(self.clients):
            c.end(why)

    async def _summaries(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SUMMARY_S)
            if self._dirty and self.view is not None:
                self._dirty = False
                self._summary = frame("summary", state.summary(self.view))
                for c in self.clients:
                    c.push(self._summary)
            self._send_traffic()

    def _send_traffic(self) -> None:
        if self.traffic is None:
            return
        doc = self.traffic()
        if doc == self._traffic_doc:
            return
        self._traffic_doc = doc
        self._traffic = frame("traffic", doc)
        for c in self.clients:
            c.push(self._traffic)

    # ------------------------------------------------------------ clients

    def listing(self) -> bytes:
        """The `list` frame of the view now, encoded once per sequence."""
        assert self.view is not None
        if self._listing is None or self._listing[0] != self.seq:
            doc = state.view_doc(self.view)
            doc["recent"] = list(self.recent)
            self._listing = (self.seq, frame("list", doc, self.seq))
        return self._listing[1]

    def attach(self, from_seq: int | None) -> Client:
        """A client that gets the listing then every change (`from_seq` None), or every
        change from `from_seq` on; one told to re-list when that is older than kept."""
        c = Client(self.client_frames)
        # Frames folded but not yet handed out go to the clients there are first: the
        # listing below already shows them.
        self._flush()
        if self.view is None:
            c.end("the dashboard has not listed the log yet; re-list")
            return c
        if from_seq is None:
            c.push(self.listing())
            if self._traffic:
                c.push(self._traffic)
        elif from_seq <= self.seq:
            first = self.ring[0][0] if self.ring else self.seq + 1
            if from_seq < first:
                c.end(f"seq {from_seq} is older than what the dashboard keeps ({first}); re-list")
                self.relisted += 1
                return c
            backlog = [d for s, d in self.ring if s >= from_seq]
            c.push(b"".join(backlog), len(backlog))
        else:
            c.skip_to = from_seq
        self.clients.add(c)
        return c

    def detach(self, c: Client) -> None:
        self.clients.discard(c)
        if c.gone is not None and c.gone.startswith("the client fell"):
            self.relisted += 1
