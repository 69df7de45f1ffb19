"""Consume loops: a durable pull consumer for work done once, an ordered reader for folds,
and the dead-letter queue both use for input that can never succeed.

Called by the services' shells: the projector, scheduler views and replay read with
`read_ordered` / `read_range` from the sequence they last applied (the projector and
the followers through `services.bus.follow`); command and reaction handlers run under
`consume_durable`. No loop here ever dies on input: a
message that does not decode or does not belong is recorded on `<root>.dlq.<consumer>`
with its reason, subject, sequence and raw bytes, acked, and the loop goes on. And no
loop here loses a message silently: the ordered reader checks every sequence it hands on.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, PubAck
from nats.js.client import JetStreamContext
from opentelemetry import trace

from schemas import codec, subjects
from schemas.errors import EventDecodeError
from schemas.events import Event
from services.bus import ordered, tracing, wire
from services.bus.connection import Fault, JetStream
from services.bus.errors import BusError, Permanent, Retry, Unanswered
from services.bus.ordered import BATCH_MAX as BATCH_MAX
from services.bus.ordered import IDLE_HEARTBEAT_S as IDLE_HEARTBEAT_S
from services.bus.ordered import Delivery as Delivery
from services.bus.publish import Published, Publisher

log = logging.getLogger("llmgw.bus")

# ------------------------------------------------------------------ deliveries


def delivery_of(msg: Msg) -> Delivery:
    delivered, sseq, _, ns, pending = ordered.ack_tokens(msg.reply)
    return Delivery(sseq, msg.subject, msg.data, msg.headers, ns, delivered, pending)


# ------------------------------------------------------------------ checked decoding


def decode_checked(delivery: Delivery, root: str = subjects.DEFAULT_ROOT) -> Event:
    """The event a delivery carries, or an error that sends it to the DLQ.

    `EventDecodeError` if the bytes are not an event of the contract; `Permanent` if the
    event does not belong on the subject it came on (an agent reporting another node's
    replica, a command on the wrong node).
    """
    event = codec.decode(delivery.data)
    why = subjects.check(event, delivery.subject, root)
    if why is not None:
        raise Permanent(f"wrong subject for its data: {why}")
    return event


# ------------------------------------------------------------------ dead letters

# DEAD_LETTERS counts dead letters per consumer in this process, for status and tests.
DEAD_LETTERS: Counter[str] = Counter()


# DLQ_KEEP_BYTES bounds how much of a dead message its record keeps. A record must always
# fit under the DLQ's max message size (stream.DLQ_MAX_MSG_BYTES, 16 KiB), whatever came
# in: a consumer retrying a dead letter that can never be stored stalls for good. And a
# flood of bad messages, which each of the plane's consumers dead-letters, must cost the
# DLQ a few KiB per message, not the message again. The size and hash of the whole body
# are kept beside the prefix, so the original can still be identified in the stream (by
# `seq`) or in an export.
DLQ_KEEP_BYTES = 4 * 1024

# DLQ_SAY_EVERY_S: a consumer's dead letters are logged one line for the first, then at
# most one line per this many seconds, saying how many more there were: a flood of bad
# input is said, not echoed line by line.
DLQ_SAY_EVERY_S = 30.0

# _said: consumer -> (monotonic time of its last line, dead letters since not logged).
_said: dict[str, tuple[float, int]] = {}


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    """The body of a message on `<root>.dlq.<consumer>`. `data_b64` is the raw message (its
    first DLQ_KEEP_BYTES when `size` is larger), base64, because what failed to decode may
    not even be UTF-8; `size` and `sha256` describe the whole of it."""

    consumer: str
    reason: str
    subject: str
    seq: int
    data_b64: str
    at: datetime
    size: int = -1
    """Bytes of the whole message; -1 in records written before sizes were kept."""
    sha256: str = ""
    """Hex digest of the whole message; empty in older records."""

    @property
    def data(self) -> bytes:
        return base64.b64decode(self.data_b64)

    @property
    def truncated(self) -> bool:
        return self.size > len(self.data)


_dlq_encoder = msgspec.json.Encoder()
_dlq_decoder = msgspec.json.Decoder(DeadLetter)


def read_dead_letter(body: bytes) -> DeadLetter:
    return _dlq_decoder.decode(body)


def _one_line(text: str, limit: int = 512) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


async def dead_letter(
    nc: Client | JetStreamContext,
    root: str,
    consumer: str,
    *,
    reason: str,
    subject: str,
    seq: int,
    data: bytes,
) -> int:
    """Record a message that can never be processed; returns its sequence in the DLQ stream.

    Published with a JetStream ack, so a dead letter is stored or this raises. Its message
    id is derived from (consumer, seq), so recording the same failure twice (a redelivery
    after a crash) stores it once.
    """
    js = nc.jetstream() if isinstance(nc, Client) else nc
    body, headers = _dead_letter_message(root, consumer, reason, subject, seq, data)
    ack = await js.publish(subjects.dlq_subject(consumer, root), body, headers=headers)
    stored = await _own(js, root, body, headers, ack)
    DEAD_LETTERS[consumer] += 1
    _say(consumer, seq, headers["Llmgw-Dlq-Subject"], headers["Llmgw-Dlq-Reason"])
    return stored


async def record(
    js: JetStreamContext, root: str, consumer: str, *, reason: str, subject: str, seq: int
) -> int:
    """A dead letter that holds no message, only a report an operator should see (a node
    at its stream's limits: `services.bus.node_streams`), stored as `dead_letter` stores
    one, under `consumer`'s subject, and not said again here: its caller said it."""
    body, headers = _dead_letter_message(root, consumer, reason, subject, seq, b"")
    ack = await js.publish(subjects.dlq_subject(consumer, root), body, headers=headers)
    stored = await _own(js, root, body, headers, ack)
    DEAD_LETTERS[consumer] += 1
    return stored


async def _own(
    js: JetStreamContext, root: str, body: bytes, headers: dict[str, str], ack: PubAck
) -> int:
    """The DLQ sequence of a dead letter, once a duplicate ack is shown to be its own
    (`Publisher.own`: an id taken by someone else's message is said, and the letter
    stored again)."""
    if not ack.duplicate:
        return ack.seq
    subject = subjects.dlq_subject(headers["Llmgw-Dlq-Consumer"], root)
    sent = Published(ack.seq, True, subject, ack.stream or "")
    return (await Publisher(js, root, retry_s=0).own(subject, body, headers, sent)).seq


def _dead_letter_message(
    root: str, consumer: str, reason: str, subject: str, seq: int, data: bytes
) -> tuple[bytes, dict[str, str]]:
    reason = _one_line(reason)
    subject = _one_line(subject)
    body = _dlq_encoder.encode(
        DeadLetter(
            consumer=consumer,
            reason=reason,
            subject=subject,
            seq=seq,
            data_b64=base64.b64encode(data[:DLQ_KEEP_BYTES]).decode("ascii"),
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            at=datetime.now(UTC),
        )
    )
    headers = {
        # Scoped by subject, as every publish's (services.bus.publish.scoped_id).
        "Nats-Msg-Id": f"{subjects.dlq_subject(consumer, root)} dlq.{consumer}.{seq}",
        "Llmgw-Dlq-Consumer": consumer,
        "Llmgw-Dlq-Subject": subject,
        "Llmgw-Dlq-Seq": str(seq),
        "Llmgw-Dlq-Reason": reason,
    }
    return body, headers


def _say(consumer: str, seq: int, subject: str, reason: str) -> None:
    now = time.monotonic()
    last, quiet = _said.get(consumer, (-math.inf, 0))
    if now - last < DLQ_SAY_EVERY_S:
        _said[consumer] = (last, quiet + 1)
        return
    _said[consumer] = (now, 0)
    more = f" ({quiet} more since the last line)" if quiet else ""
    log.warning("dead letter for %s: seq %d on %s: %s%s", consumer, seq, subject, reason, more)


class Dead(Protocol):
    """What a folder hands on about a message it could not fold."""

    @property
    def seq(self) -> int: ...
    @property
    def subject(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def data(self) -> bytes: ...


async def dead_letters(
    js: JetStreamContext, root: str, consumer: str, records: Sequence[Dead]
) -> None:
    """`dead_letter` for each of a folder's dead records, in order, sent without waiting
    for each ack (a flood of bad input is thousands of them) and returning once every
    one is stored; raises at the first that is not."""
    subject = subjects.dlq_subject(consumer, root)
    for start in range(0, len(records), DLQ_WINDOW):
        window = records[start : start + DLQ_WINDOW]
        sent = []
        for x in window:
            body, headers = _dead_letter_message(root, consumer, x.reason, x.subject, x.seq, x.data)
            sent.append((body, headers, await js.publish_async(subject, body, headers=headers)))
        futures = [f for _, _, f in sent]
        try:
            acks = await asyncio.wait_for(asyncio.gather(*futures), DLQ_ACK_TIMEOUT_S)
        except TimeoutError:
            for f in futures:
                f.cancel()
            raise nats.errors.TimeoutError from None
        for (body, headers, _), ack in zip(sent, acks, strict=True):
            await _own(js, root, body, headers, ack)
        for x in window:
            DEAD_LETTERS[consumer] += 1
            _say(consumer, x.seq, _one_line(x.subject), _one_line(x.reason))


# DLQ_WINDOW is how many dead letters `dead_letters` keeps in flight; DLQ_ACK_TIMEOUT_S
# bounds the wait for their acks (nats-py's async publishes have no timeout of their own).
DLQ_WINDOW = 500
DLQ_ACK_TIMEOUT_S = 10.0


# ------------------------------------------------------------------ spans


def _process_span(delivery: Delivery, group: str):  # type: ignore[no-untyped-def]
    """A CONSUMER span for one message, in the producer's trace and linked to its span."""
    ctx = tracing.extract(delivery.headers)
    sc = tracing.span_context_of(ctx)
    return tracing.tracer().start_as_current_span(
        f"process {delivery.subject}",
        context=ctx,
        kind=trace.SpanKind.CONSUMER,
        links=[trace.Link(sc)] if sc is not None else None,
        attributes={
            "messaging.system": tracing.SYSTEM,
            "messaging.destination.name": delivery.subject,
            "messaging.message.id": delivery.msg_id or "",
            "messaging.consumer.group.name": group,
            "messaging.operation.type": "process",
            "messaging.nats.stream.sequence": delivery.seq,
            "messaging.nats.delivered": delivery.delivered,
        },
    )


# ------------------------------------------------------------------ durable consumer

Handler = Callable[[Delivery], Awaitable[None]]

# BACKOFF_S is how long a failed message waits before its next delivery, by attempt.
# Spread out so a dependency that is down for a minute is waited out, not hammered.
BACKOFF_S: tuple[float, ...] = (1.0, 5.0, 15.0, 60.0)


async def consume_durable(
    js: JetStreamContext,
    *,
    durable: str,
    filter_subject: str,
    handler: Handler,
    stop: asyncio.Event,
    batch: int = 100,
    ack_wait_s: float = 30.0,
    max_deliver: int = 5,
    backoff: Sequence[float] = BACKOFF_S,
    root: str = subjects.DEFAULT_ROOT,
    stream: str = subjects.STREAM,
    fetch_timeout_s: float = 1.0,
    bind: bool = False,
) -> None:
    """Run `handler` on every message of a durable pull consumer until `stop` is set.

    With `bind` the consumer is only bound to, never created or configured: someone else
    made it (an agent's, made by the control plane: `services.agent.consumers`).

    Explicit ack, one message at a time in stream order within each fetched batch. A
    handler that returns acks; `Retry` naks with its delay; `Permanent` or
    `EventDecodeError` dead-letters and acks; any other exception is logged with the
    sequence and nak'ed with `backoff`. On its `max_deliver`-th failure a message is
    dead-lettered with the last error rather than dropped, so nothing vanishes unrecorded.

    The backoff is applied by nak delays, not the consumer's server-side `backoff`: that
    one replaces `ack_wait`, and would redeliver a message whose handler is merely slow.
    """
    config = ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
        filter_subject=filter_subject,
        deliver_policy=DeliverPolicy.ALL,
    )

    async def subscribe() -> Any:
        if bind:
            return await js.pull_subscribe_bind(durable, stream)
        return await js.pull_subscribe(
            filter_subject, durable=durable, stream=stream, config=config
        )

    psub = await subscribe()
    # stale: the subscription is bound anew before the next fetch. In a cluster, a server
    # that dies can take the consumer's leader with it; fetches then fail (no responders)
    # or time out while messages wait, until the subscription finds the new leader.
    stale, idle = False, 0
    fault = Fault()
    try:
        while not stop.is_set():
            if stale:
                try:
                    with contextlib.suppress(nats.errors.Error):
                        await psub.unsubscribe()
                    psub = await subscribe()
                    stale = False
                except nats.errors.ConnectionClosedError:
                    return
                except (nats.errors.Error, TimeoutError) as e:
                    log.debug("consumer %s: binding again failed: %s", durable, e)
                    await _pause(stop, 0.5)
                    continue
            try:
                msgs = await psub.fetch(batch, timeout=fetch_timeout_s)
            except (TimeoutError, nats.errors.TimeoutError):
                idle += 1
                if idle % REBIND_AFTER_IDLE == 0:
                    stale = await _waiting(psub)
                continue
            except nats.errors.ConnectionClosedError:
                return
            except nats.errors.Error as e:
                # Said once, then once per period while it lasts (`Fault`).
                if fault.began():
                    log.warning("consumer %s: fetch failed: %s", durable, e)
                elif n := fault.due():
                    log.warning(
                        "consumer %s: fetch still failing after %.0fs: %d attempt(s) since "
                        "the last line: %s",
                        durable,
                        fault.lasted(),
                        n,
                        e,
                    )
                stale = True
                await _pause(stop, 0.5)
                continue
            repeated, lasted = fault.repeated, fault.ended()
            if lasted is not None and repeated:
                log.info("consumer %s: fetching again after %.0fs", durable, lasted)
            idle = 0
            for msg in msgs:
                await _handle_one(js, msg, durable, handler, max_deliver, backoff, root)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await psub.unsubscribe()


# REBIND_AFTER_IDLE is how many empty fetches in a row make a durable consumer ask
# whether messages are waiting all the same (then its subscription is bound anew).
REBIND_AFTER_IDLE = 5


async def _waiting(psub: Any) -> bool:
    """Whether the consumer holds messages that the empty fetches did not bring."""
    try:
        info = await psub.consumer_info()
    except (nats.errors.Error, TimeoutError):
        return True
    return bool(info.num_pending)


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    """Wait `seconds` unless `stop` is set first."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def _handle_one(
    js: JetStreamContext,
    msg: Msg,
    durable: str,
    handler: Handler,
    max_deliver: int,
    backoff: Sequence[float],
    root: str,
) -> None:
    d = delivery_of(msg)
    with _process_span(d, durable) as span:
        try:
            await handler(d)
        except (Permanent, EventDecodeError) as e:
            span.set_attribute("llmgw.outcome", "dead_letter")
            await _dead_letter_and_ack(js, msg, d, durable, root, str(e))
            return
        except Retry as e:
            span.set_attribute("llmgw.outcome", "retry")
            await _retry_or_give_up(js, msg, d, durable, root, e.delay_s, e.reason, max_deliver)
            return
        except Exception as e:
            span.record_exception(e)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)))
            log.error(
                "consumer %s: handler failed on seq %d (%s), attempt %d of %d: %s: %s",
                durable,
                d.seq,
                d.subject,
                d.delivered,
                max_deliver,
                type(e).__name__,
                e,
            )
            delay = backoff[min(d.delivered - 1, len(backoff) - 1)] if backoff else 0.0
            why = f"handler failed {d.delivered} times, last: {type(e).__name__}: {e}"
            await _retry_or_give_up(js, msg, d, durable, root, delay, why, max_deliver)
            return
        try:
            await msg.ack()
        except nats.errors.Error as e:
            # The ack is lost; the message comes back after ack_wait and the handler, which
            # must be idempotent, sees it again.
            log.warning("consumer %s: ack of seq %d failed: %s", durable, d.seq, e)


async def _retry_or_give_up(
    js: JetStreamContext,
    msg: Msg,
    d: Delivery,
    durable: str,
    root: str,
    delay_s: float,
    reason: str,
    max_deliver: int,
) -> None:
    if max_deliver > 0 and d.delivered >= max_deliver:
        await _dead_letter_and_ack(js, msg, d, durable, root, f"gave up: {reason}")
        return
    try:
        await msg.nak(delay=delay_s)
    except nats.errors.Error as e:
        log.warning("consumer %s: nak of seq %d failed: %s", durable, d.seq, e)


async def _dead_letter_and_ack(
    js: JetStreamContext, msg: Msg, d: Delivery, durable: str, root: str, reason: str
) -> None:
    try:
        await dead_letter(
            js, root, durable, reason=reason, subject=d.subject, seq=d.seq, data=d.data
        )
    except Exception as e:
        # Invariant: a message is acked only once its dead letter is stored. If the DLQ
        # cannot take it, the message stays unacked and comes back.
        log.error("consumer %s: dead letter for seq %d not stored: %s", durable, d.seq, e)
        return
    try:
        await msg.ack()
    except nats.errors.Error as e:
        log.warning("consumer %s: ack of seq %d failed: %s", durable, d.seq, e)


# ------------------------------------------------------------------ ordered reader


def _reader(
    js: JetStreamContext,
    *,
    from_seq: int,
    filter_subject: str | None,
    stream: str,
    until_seq: int | None,
    to_end: bool,
    stop: asyncio.Event | None,
    batch_max: int,
    consumer: str | None = None,
    label: str | None = None,
) -> ordered.OrderedReader:
    """The wire reader (`services.bus.wire`) for a JetStream context of `bus.connect`,
    which carries where to connect, unless its connection was made without it
    (`--no-wire-reader`) or uses what the wire reader does not speak (nkeys, credentials
    files); else the nats-py reader."""
    kw: dict[str, Any] = dict(
        from_seq=from_seq,
        filter_subject=filter_subject,
        stream=stream,
        until_seq=until_seq,
        to_end=to_end,
        stop=stop,
        batch_max=batch_max,
        consumer=consumer,
    )
    if isinstance(js, JetStream) and js.target.wire:
        if not js.target.unsupported:
            return wire.WireOrderedReader(js, js.target, label=label, **kw)
        log.debug("wire reader not used: %s", js.target.unsupported)
    return ordered.NatsOrderedReader(js, **kw)


async def read_ordered(
    js: JetStreamContext,
    *,
    from_seq: int,
    on_batch: Callable[[list[Delivery]], Awaitable[None] | None],
    filter_subject: str | None = None,
    batch_max: int = BATCH_MAX,
    stop: asyncio.Event | None = None,
    until_seq: int | None = None,
    stream: str = subjects.STREAM,
    label: str | None = None,
) -> int:
    """Hand every message from `from_seq` on to `on_batch`, in order, until `stop` is set or
    `until_seq` is handed on. Returns the last stream sequence handed on. `label` names
    the reader's connection (whose reader it is: "projector").

    Raises `SequenceGap` if a message went missing: without a filter every stream
    sequence must follow the one before; with one, every consumer sequence. The caller
    restarts from its checkpoint.
    """
    reader = _reader(
        js,
        from_seq=from_seq,
        filter_subject=filter_subject,
        stream=stream,
        until_seq=until_seq,
        to_end=False,
        stop=stop,
        batch_max=batch_max,
        label=label,
    )
    async with contextlib.aclosing(reader.batches()) as batches:
        async for batch in batches:
            r = on_batch(batch)
            if r is not None:
                await r
    return reader.last_seq


async def read_range(
    js: JetStreamContext,
    from_seq: int = 1,
    until_seq: int | None = None,
    *,
    filter_subject: str | None = None,
    batch_max: int = BATCH_MAX,
    stream: str = subjects.STREAM,
    consumer: str | None = None,
) -> AsyncIterator[list[Delivery]]:
    """Batches of messages from `from_seq` to `until_seq`, or to the end of the stream as it
    is when each message is sent; then it stops. For export and replay.

    `consumer` names the reader's consumer, for a reader whose permissions allow it one
    name only (an agent: `$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`); one reader
    at a time per name. Without it each reader's consumer gets a name of its own."""
    reader = _reader(
        js,
        from_seq=from_seq,
        filter_subject=filter_subject,
        stream=stream,
        until_seq=until_seq,
        to_end=True,
        stop=None,
        batch_max=batch_max,
        consumer=consumer,
    )
    # Closed here, not when collected: the wire reader holds a connection.
    async with contextlib.aclosing(reader.batches()) as batches:
        async for batch in batches:
            yield batch


# ------------------------------------------------------------------ a pull consumer, rewound

# RESET_WAIT_S bounds the wait for the server's answer to a consumer reset or a fetch.
RESET_WAIT_S = 5.0


async def read_pulled(
    js: JetStreamContext,
    consumer: str,
    from_seq: int = 1,
    *,
    only: str | None = None,
    stream: str = subjects.STREAM,
    batch_max: int = BATCH_MAX,
) -> AsyncGenerator[list[Delivery], None]:
    """Batches of what the pull consumer `consumer` (made by someone else, no acks,
    deliver-all) holds from `from_seq` to the end of the stream as it is when each
    message is sent, then it stops; `only` keeps the subjects it matches.

    For a reader whose permissions allow it to pull one consumer and create none (an
    agent): the consumer is reset to `from_seq` (`$JS.API.CONSUMER.RESET`, nats-server
    2.14 and later), and pulled until the server says nothing is pending. One reader at a
    time per consumer. Raises BusError when the server refuses, `Unanswered` when it
    does not answer in time."""
    api = getattr(js, "_prefix", "$JS.API")
    try:
        msg = await js._nc.request(
            f"{api}.CONSUMER.RESET.{stream}.{consumer}",
            json.dumps({"seq": max(1, from_seq)}).encode(),
            timeout=RESET_WAIT_S,
        )
    except (nats.errors.Error, TimeoutError) as e:
        raise Unanswered(f"consumer {consumer}: reset to {from_seq} not answered: {e}") from e
    answer = json.loads(msg.data)
    if "error" in answer:
        why = answer["error"].get("description", answer["error"])
        raise BusError(f"consumer {consumer}: reset to {from_seq} refused: {why}")
    left = int(answer.get("num_pending", 0))
    if left == 0:
        # The reset's answer can count a consumer made a moment ago as having nothing
        # pending while the stream holds what it filters: its own info is asked once.
        try:
            left = (await js.consumer_info(stream, consumer, timeout=RESET_WAIT_S)).num_pending or 0
        except (nats.errors.Error, TimeoutError) as e:
            raise Unanswered(f"consumer {consumer}: its info not answered: {e}") from e
    if left == 0:
        return
    psub = await js.pull_subscribe_bind(consumer, stream)
    try:
        while left > 0:
            try:
                msgs = await psub.fetch(min(batch_max, left), timeout=RESET_WAIT_S)
            except (nats.errors.TimeoutError, TimeoutError) as e:
                raise Unanswered(f"consumer {consumer}: {left} messages pending, none came") from e
            out = []
            for m in msgs:
                d = delivery_of(m)
                left = d.pending
                if only is None or matches(d.subject, only):
                    out.append(d)
            if out:
                yield out
    finally:
        with contextlib.suppress(nats.errors.Error):
            await psub.unsubscribe()


def matches(subject: str, pattern: str) -> bool:
    """Whether `subject` is one `pattern` (with NATS wildcards `*` and `>`) names."""
    got, want = subject.split("."), pattern.split(".")
    for i, w in enumerate(want):
        if w == ">":
            return len(got) > i
        if i >= len(got) or (w != "*" and w != got[i]):
            return False
    return len(got) == len(want)
