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
    same_gap, last_gap = 0, -1

    # failing counts the reads failed in a row: the first is said, the rest of one outage
    # are not (the connection already says the broker is away, once, and when it is back).
    failing = 0

    async def checked(batch: list[Delivery]) -> None:
        nonlocal failing
        failing = 0
        want = position() + 1
        if batch[0].seq != want:
            raise SequenceGap(want, batch[0].seq)
        if tracing.enabled():
            for d in batch:
                if d.headers:
                    tracing.remember(d.seq, d.headers, d.msg_id, d.subject)
            with _batch_span(batch, name, stream):
                r = on_batch(batch)
                if r is not None:
                    await r
        else:
            r = on_batch(batch)
            if r is not None:
                await r

    origin = await _origin_or_none(js, stream)

    async def restarted(e: BaseException) -> None:
        # Whatever went wrong, the stream may have been replaced meanwhile (deleted and
        # created again): reading on by sequence would fold another log's events.
        nonlocal origin
        now = await _origin_or_none(js, stream)
        if origin is not None and now is not None and now != origin:
            raise StreamReplaced(stream, origin, now) from e
        origin = origin or now
        if restart is not None:
            r = restart(e)
            if r is not None:
                await r

    # reading ends a read when `stop` is set, or when `watch` finds the stream replaced.
    reading = asyncio.Event()
    replaced: list[str] = []

    async def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), ORIGIN_CHECK_S)
            now = await _origin_or_none(js, stream)
            if origin is not None and now is not None and now != origin:
                replaced.append(now)
                break
        reading.set()

    watcher = asyncio.create_task(watch(), name=f"{name}: stream origin")
    try:
        while not stop.is_set():
            try:
                await consume.read_ordered(
                    js,
                    from_seq=position() + 1,
                    on_batch=checked,
                    stop=reading,
                    batch_max=batch_max,
                    stream=stream,
                    label=name,
                )
                if replaced:
                    raise StreamReplaced(stream, origin or "?", replaced[0])
            except (SequenceGap, Gap) as e:
                await restarted(e)
                missing = e.expected
                same_gap = same_gap + 1 if missing == last_gap else 1
                last_gap = missing
                log.warning("%s: %s; reading again from %d", name, e, position() + 1)
                if same_gap >= GAP_RETRIES and not await message_exists(js, missing, stream):
                    raise LogHole(missing, stream) from e
            except nats.errors.ConnectionClosedError:
                return False
            except (nats.errors.Error, TimeoutError) as e:
                # The broker went away or restarted: read again from where we are.
                failing += 1
                if failing == 1:
                    log.warning("%s: read failed (%s); retrying until it works", name, e)
                else:
                    log.debug("%s: read failed again (%s)", name, e)
                await restarted(e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), RETRY_PAUSE_S)
        return True
    finally:
        watcher.cancel()


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
