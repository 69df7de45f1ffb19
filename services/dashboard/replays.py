"""Replays of past moments for the dashboard, off the event loop that holds the leases.

Called by the dashboard's routes (`server`) for everything that folds the log again:
`/api/view?seq=|at=`, `/api/explain/...`, `/api/history/...` and `/api/plan?seq=|at=`.
In `llmgw up` the dashboard shares its event loop with the scheduler, the preemption
service, the projector and their leases; a fold of the whole log there is a pause of
all of them, and 64 such requests at once were a minute without a leader. So:

- each replay runs on a worker thread with an event loop and a broker connection of its
  own (made from the `Target` the dashboard's connection recorded), and hands back the
  answer already encoded (`Answer`): the folded view never crosses to the server's loop,
  and is garbage once the answer is made;
- at most `AT_ONCE` replays run at once and `WAITING` more wait; past that a request is
  `Busy` (503 with Retry-After), never a queue without bound;
- answers for a moment that cannot change (a sequence at or before the dashboard's head,
  a time the log has passed) are kept by what they name, the most recent `KEEP` of them
  and at most `KEEP_BYTES`, so a slider dragged back and forth costs one replay a
  moment; the same request made while its replay runs waits for that one.

It must not publish or write to the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from services.core import policy
from services.core.view import View
from services.dashboard import state
from services.dashboard.errors import Busy
from services.dashboard.query import Moment
from services.replay import explain, history, rebuild
from services.replay.errors import ReplayError, UnknownEntity

log = logging.getLogger("llmgw.dashboard")

# AT_ONCE is how many replays run at once. A fold is Python on one core: a second one
# at once keeps a long replay from holding up a short one, a third would only slow the
# loop that holds the leases (they share the interpreter's lock).
AT_ONCE = 2
# WAITING is how many more may wait for a turn; past it a request is answered 503.
WAITING = 2
# RETRY_AFTER_S is what a 503 asks the client to wait: about one replay of a 40k-event
# log, twice over.
RETRY_AFTER_S = 2
# KEEP and KEEP_BYTES bound the answers kept for past moments.
KEEP = 64
KEEP_BYTES = 32 * 1024 * 1024
# REPLAY_S bounds one replay, waiting for its turn excluded: a broker that does not answer
# (the worker's reader reconnects until it does) must not hold a turn for good. A log of
# a million events folds in well under it.
REPLAY_S = 120.0
# CLOSE_S bounds the wait for the worker thread when the dashboard stops.
CLOSE_S = 5.0


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP answer made by a replay: its status and JSON body. `final`: it is about
    a moment the log has passed for good, so it may be kept."""

    status: int
    body: bytes
    final: bool = True


Work = Callable[[Any], Coroutine[Any, Any, Answer]]
"""A replay: given a JetStream context (the worker's), the answer."""


class Replays:
    """The worker, its bounds and its kept answers; one per dashboard."""

    def __init__(
        self,
        js: Any,
        *,
        at_once: int = AT_ONCE,
        waiting: int = WAITING,
        keep: int = KEEP,
        keep_bytes: int = KEEP_BYTES,
    ) -> None:
        self.js = js
        self.at_once = at_once
        self.waiting = waiting
        self.keep = keep
        self.keep_bytes = keep_bytes
        self.kept: OrderedDict[Hashable, Answer] = OrderedDict()
        self.kept_bytes = 0
        self.ran = 0
        """Replays run (for tests and metrics)."""
        self.refused = 0
        """Requests answered `Busy`."""
        self._open: set[asyncio.Task[Answer]] = set()
        self._flights: dict[Hashable, asyncio.Task[Answer]] = {}
        self._turns: asyncio.Semaphore | None = None
        self._starting: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._nc: Any = None
        self._wjs: Any = None
        self._inline = False

    @property
    def running(self) -> int:
        """Replays running or waiting for a turn."""
        return len(self._open)

    async def answer(self, key: Hashable | None, work: Work) -> Answer:
        """The answer `work` makes, kept under `key` when final; `key` None: never kept
        and never shared (a moment past the head, or the log to its end). `Busy` when
        the bound is reached."""
        if key is not None:
            got = self.kept.get(key)
            if got is not None:
                self.kept.move_to_end(key)
                return got
            flying = self._flights.get(key)
            if flying is not None:
                return await asyncio.shield(flying)
        if len(self._open) >= self.at_once + self.waiting:
            self.refused += 1
            raise Busy(len(self._open), RETRY_AFTER_S)
        task = asyncio.create_task(self._fly(key, work), name="dashboard: replay")
        self._open.add(task)
        task.add_done_callback(self._landed)
        if key is not None:
            self._flights[key] = task
        # Shielded: a client that goes away does not cancel a replay others wait for,
        # and the bound counts the replay until it really ends.
        return await asyncio.shield(task)

    def _landed(self, task: asyncio.Task[Answer]) -> None:
        self._open.discard(task)
        for k, t in list(self._flights.items()):
            if t is task:
                del self._flights[k]
        if not task.cancelled():
            task.exception()  # retrieved here: its waiters may all have gone

    async def _fly(self, key: Hashable | None, work: Work) -> Answer:
        if self._turns is None:
            self._turns = asyncio.Semaphore(self.at_once)
        async with self._turns:
            self.ran += 1
            wjs = await self._worker()
            if wjs is None:
                got = await asyncio.wait_for(work(self.js), REPLAY_S)
            else:
                assert self._loop is not None
                fut = asyncio.run_coroutine_threadsafe(work(wjs), self._loop)
                # A timeout cancels the replay on the worker's loop too.
                got = await asyncio.wait_for(asyncio.wrap_future(fut), REPLAY_S)
        if key is not None and got.final:
            self._keep(key, got)
        return got

    def _keep(self, key: Hashable, got: Answer) -> None:
        if len(got.body) > self.keep_bytes:
            return
        self.kept[key] = got
        self.kept_bytes += len(got.body)
        while len(self.kept) > self.keep or self.kept_bytes > self.keep_bytes:
            _, old = self.kept.popitem(last=False)
            self.kept_bytes -= len(old.body)

    # ------------------------------------------------------------ the worker

    async def _worker(self) -> Any:
        """The worker's JetStream context, started at the first replay; None when the
        dashboard's connection records no `Target` the worker can connect with (replays
        then run on the server's loop, bounded and kept all the same)."""
        if self._wjs is not None or self._inline:
            return self._wjs
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._wjs is not None or self._inline:
                return self._wjs
            target = getattr(self.js, "target", None)
            if target is None or target.unsupported:
                why = "no target recorded" if target is None else target.unsupported
                log.info("dashboard: replays run on the server's loop (%s)", why)
                self._inline = True
                return None
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=loop.run_forever, name="llmgw dashboard replays", daemon=True
            )
            thread.start()
            try:
                fut = asyncio.run_coroutine_threadsafe(_connect(target), loop)
                nc = await asyncio.wrap_future(fut)
            except BaseException:
                loop.call_soon_threadsafe(loop.stop)
                await asyncio.to_thread(thread.join, CLOSE_S)
                loop.close()
                raise
            self._loop, self._thread, self._nc = loop, thread, nc
            self._wjs = nc.jetstream(prefix=target.api_prefix)
            return self._wjs

    async def close(self) -> None:
        """Cancel what runs, close the worker's connection, end its thread."""
        for t in list(self._open):
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._open, return_exceptions=True)
        loop, thread, nc = self._loop, self._thread, self._nc
        self._loop = self._thread = self._nc = self._wjs = None
        if loop is None or thread is None:
            return
        fut = asyncio.run_coroutine_threadsafe(_shutdown(nc), loop)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.wrap_future(fut), CLOSE_S)
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join, CLOSE_S)
        if not thread.is_alive():
            loop.close()


async def _connect(target: Any) -> Any:
    """A connection of the worker's own, to the servers and with the credentials of the
    dashboard's (`connection.Target`)."""
    from services.bus import connection

    scheme = "tls" if target.tls is not None else "nats"
    urls = [
        f"{scheme}://[{h}]:{p}" if ":" in h else f"{scheme}://{h}:{p}" for h, p in target.servers
    ]
    opts: dict[str, Any] = {}
    if target.tls is not None:
        opts["tls"] = target.tls
        if target.tls_hostname:
            opts["tls_hostname"] = target.tls_hostname
    if target.inbox_prefix != "_INBOX":
        opts["inbox_prefix"] = target.inbox_prefix
    return await connection.connect(
        urls,
        "llmgw dashboard (replays)",
        user=target.user,
        password=target.password,
        token=target.token,
        **opts,
    )


async def _shutdown(nc: Any) -> None:
    """On the worker's loop: cancel its replays, then close its connection."""
    me = asyncio.current_task()
    rest = [t for t in asyncio.all_tasks() if t is not me]
    for t in rest:
        t.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
    from services.bus import connection

    await connection.close(nc)


# ------------------------------------------------------------ the replays (worker side)


async def view(js: Any, m: Moment, everything: bool, root: str) -> Answer:
    """The whole view as it stood at `m` (`state.view_doc`)."""
    got = await rebuild.from_stream(js, until_seq=m.seq, until_time=m.at, root=root)
    doc = state.view_doc(got.view, everything=everything, with_digest=True)
    return Answer(200, dumps(doc), final=m.at is None or got.source.stats.cut_at is not None)


async def story(
    js: Any,
    what: str,
    kind: str,
    name: str,
    seq: int | None,
    root: str,
    now: datetime | None = None,
) -> Answer:
    """`explain` or `history` of one entity, up to `seq` (None: the log's end); ages
    counted from `now` (None: the view's own time)."""
    try:
        if what == "explain":
            w: Any = explain.Explainer(name, root, kind=kind)
            got = await rebuild.from_stream(js, until_seq=seq, watcher=w, root=root)
            doc = w.story(got.view, now).to_json()
        else:
            w = history.Timeline(kind, name, root)
            got = await rebuild.from_stream(js, until_seq=seq, watcher=w, root=root)
            w.resolve(history.known(got.view, kind))
            w.require()
            doc = {"kind": kind, "name": w.name, "entries": [e.to_json() for e in w.entries]}
    except UnknownEntity as e:
        return Answer(404, error(str(e)))
    except ReplayError as e:
        return Answer(409, error(str(e)))
    return Answer(200, dumps(doc))


async def plan(js: Any, m: Moment, model: str, cfg: policy.Config, root: str) -> Answer:
    """What the policy would decide for `model` at the moment `m`."""
    got = await rebuild.from_stream(js, until_seq=m.seq, until_time=m.at, root=root)
    status, doc = plan_of(got.view, model, cfg)
    return Answer(status, dumps(doc), final=m.at is None or got.source.stats.cut_at is not None)


def plan_of(v: View, model: str, cfg: policy.Config) -> tuple[int, dict[str, Any]]:
    """(status, document) of `/api/plan` on the view `v`."""
    if v.catalog.resolve(model) is None:
        return 404, {"error": f"unknown model {model!r}"}
    if v.state.time is None:
        return 409, {"error": "the log holds no events"}
    return 200, policy.plan(v, model, v.state.time, cfg).to_json()


def dumps(doc: Any) -> bytes:
    """JSON as the server's other answers are written (times and other objects as
    strings)."""
    return json.dumps(
        doc, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=str
    ).encode()


def error(text: str) -> bytes:
    return dumps({"error": text})
