"""The follow loop: the log read in order from a position, for as long as the caller asks.

Used by every reader that keeps a view current: the projector, `ViewFollower` and the
live tail of `replay.subscribe`. It reads from the caller's position plus one with the
ordered reader (`consume.read_ordered`), hands each batch on in order, and handles what
goes wrong on the way, here and nowhere else:
- a gap (a message that did not arrive: the reader's `SequenceGap`, a batch that does
  not start right after the position, or ingest's `Gap` from inside the batch): read
  again from the position. If the same
  sequence is still missing after GAP_RETRIES reads and the stream no longer holds it,
  the log has a hole and `LogHole` ends the loop;
- a broker that went away or restarted: pause RETRY_PAUSE_S, read again;
- a closed connection: return.

It never decodes or folds (that is `services.core.ingest`'s), and never acks: the
position is the caller's, read again before every read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import nats.errors
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError
from opentelemetry import trace

from schemas import subjects
from services.bus import consume, tracing
from services.bus.consume import Delivery
from services.bus.errors import LogHole, SequenceGap, StreamReplaced
from services.core.ingest import Gap

log = logging.getLogger("llmgw.follow")

# GAP_RETRIES is how often the same missing sequence is re-read before the stream is
# asked whether the message still exists. A gap from a lost delivery heals on re-read;
# one from a deleted message never does.
GAP_RETRIES = 3

# RETRY_PAUSE_S is the wait before reading again after the broker went away.
RETRY_PAUSE_S = 0.5

# ORIGIN_CHECK_S is how often a follower asks whether its stream is still the one it
# started on. A stream deleted and created again under a quiet reader raises no error:
# the reader just waits at a sequence the new stream has not reached, and its view would
# go silently stale. One STREAM.INFO request every few seconds finds it.
ORIGIN_CHECK_S = 5.0

# MAX_LINKS bounds the links on one batch span: the SDK keeps 128 by default, and past a
# few dozen a trace view shows nothing more useful.
MAX_LINKS = 64

OnBatch = Callable[[list[Delivery]], Awaitable[None] | None]
Restart = Callable[[BaseException], Awaitable[None] | None]


async def message_exists(js: JetStreamContext, seq: int, stream: str = subjects.STREAM) -> bool:
    """Whether the stream still holds message `seq` (False once deleted)."""
    try:
        await js.get_msg(stream, seq)
    except NotFoundError:
        return False
    return True


async def stream_origin(
    js: JetStreamContext, stream: str = subjects.STREAM
) -> tuple[str | None, int]:
    """(When `stream` was created, as the broker says, and its last sequence); (None, 0)
    when there is no such stream. A stream deleted and created again, or another
    cluster's, has another origin: sequences of one mean nothing in the other."""
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        return None, 0
    created = info.created
    last = info.state.last_seq or 0
    if created is None:
        return None, last
    return (created if isinstance(created, str) else created.isoformat()), last


async def follow(
    js: JetStreamContext,
    *,
    position: Callable[[], int],
    on_batch: OnBatch,
    stop: asyncio.Event,
    restart: Restart | None = None,
    name: str = "follower",
    batch_max: int = consume.BATCH_MAX,
    stream: str = subjects.STREAM,
) -> bool:
    """Hand every message after `position()` to `on_batch`, in order, until `stop` is set.

    `restart(error)` runs after a gap or a failed read, before reading again from
    `position()` (the projector reloads its checkpoint there). Returns True once
    stopped, False when the connection was closed; raises `LogHole` for a message
    deleted from the log, and whatever `on_batch` raises.
    """
    loop = _Follow(js, position, on_batch, stop, restart, name, stream)
    loop.origin = await _origin_or_none(js, stream)
    watcher = asyncio.create_task(loop.watch(), name=f"{name}: stream origin")
    try:
        while not stop.is_set():
            try:
                await consume.read_ordered(
                    js,
                    from_seq=position() + 1,
                    on_batch=loop.checked,
                    stop=loop.reading,
                    batch_max=batch_max,
                    stream=stream,
                    label=name,
                )
                if loop.replaced:
                    raise StreamReplaced(stream, loop.origin or "?", loop.replaced[0])
            except (SequenceGap, Gap) as e:
                await loop.gap(e)
            except nats.errors.ConnectionClosedError:
                return False
            except (nats.errors.Error, TimeoutError) as e:
                await loop.failed(e)
        return True
    finally:
        watcher.cancel()


class _Follow:
    """What one `follow` loop keeps between its reads, and what it does with each
    batch, gap and failed read."""

    def __init__(
        self,
        js: JetStreamContext,
        position: Callable[[], int],
        on_batch: OnBatch,
        stop: asyncio.Event,
        restart: Restart | None,
        name: str,
        stream: str,
    ) -> None:
        self.js, self.position, self.on_batch, self.stop = js, position, on_batch, stop
        self.restart, self.name, self.stream = restart, name, stream
        # The missing sequence of the last gap, and how many gaps in a row it was.
        self.same_gap, self.last_gap = 0, -1
        # failing counts the reads failed in a row: the first is said, the rest of one
        # outage are not (the connection already says the broker is away, once, and
        # when it is back).
        self.failing = 0
        self.origin: str | None = None
        # reading ends a read when `stop` is set, or when `watch` finds the stream
        # replaced (its new origin in `replaced`).
        self.reading = asyncio.Event()
        self.replaced: list[str] = []

    async def checked(self, batch: list[Delivery]) -> None:
        """A batch handed on, once it starts right after the position."""
        self.failing = 0
        want = self.position() + 1
        if batch[0].seq != want:
            raise SequenceGap(want, batch[0].seq)
        if tracing.enabled():
            for d in batch:
                if d.headers:
                    tracing.remember(d.seq, d.headers, d.msg_id, d.subject)
            with _batch_span(batch, self.name, self.stream):
                r = self.on_batch(batch)
                if r is not None:
                    await r
        else:
            r = self.on_batch(batch)
            if r is not None:
                await r

    async def restarted(self, e: BaseException) -> None:
        """Before reading again: whatever went wrong, the stream may have been replaced
        meanwhile (deleted and created again), and reading on by sequence would fold
        another log's events."""
        now = await _origin_or_none(self.js, self.stream)
        if self.origin is not None and now is not None and now != self.origin:
            raise StreamReplaced(self.stream, self.origin, now) from e
        self.origin = self.origin or now
        if self.restart is not None:
            r = self.restart(e)
            if r is not None:
                await r

    async def gap(self, e: SequenceGap | Gap) -> None:
        """A message did not arrive: read again; a hole once the same one is missing
        GAP_RETRIES times and the stream no longer holds it."""
        await self.restarted(e)
        missing = e.expected
        self.same_gap = self.same_gap + 1 if missing == self.last_gap else 1
        self.last_gap = missing
        log.warning("%s: %s; reading again from %d", self.name, e, self.position() + 1)
        if self.same_gap >= GAP_RETRIES and not await message_exists(self.js, missing, self.stream):
            raise LogHole(missing, self.stream) from e

    async def failed(self, e: BaseException) -> None:
        """The broker went away or restarted: read again from where we are."""
        self.failing += 1
        if self.failing == 1:
            log.warning("%s: read failed (%s); retrying until it works", self.name, e)
        else:
            log.debug("%s: read failed again (%s)", self.name, e)
        await self.restarted(e)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), RETRY_PAUSE_S)

    async def watch(self) -> None:
        """Every ORIGIN_CHECK_S, whether the stream is still the one it started on."""
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), ORIGIN_CHECK_S)
            now = await _origin_or_none(self.js, self.stream)
            if self.origin is not None and now is not None and now != self.origin:
                self.replaced.append(now)
                break
        self.reading.set()


async def _origin_or_none(js: JetStreamContext, stream: str) -> str | None:
    try:
        return (await stream_origin(js, stream))[0]
    except (nats.errors.Error, TimeoutError):
        return None  # the broker is away: asked again after the next failure


def _batch_span(batch: list[Delivery], group: str, stream: str):  # type: ignore[no-untyped-def]
    """One CONSUMER span for a folded batch, linked to the producers of its messages."""
    links = []
    for d in batch:
        sc = tracing.span_context_of(tracing.extract(d.headers)) if d.headers else None
        if sc is not None:
            links.append(trace.Link(sc))
            if len(links) >= MAX_LINKS:
                break
    return tracing.tracer().start_as_current_span(
        f"process {batch[0].subject if len(batch) == 1 else 'batch'}",
        kind=trace.SpanKind.CONSUMER,
        links=links,
        attributes={
            "messaging.system": tracing.SYSTEM,
            "messaging.destination.name": stream,
            "messaging.consumer.group.name": group,
            "messaging.operation.type": "process",
            "messaging.batch.message_count": len(batch),
            "messaging.nats.stream.sequence": batch[-1].seq,
        },
    )
