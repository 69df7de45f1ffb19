"""Ordered reads of the log: the message shape, the reader protocol, the sequence checks
both readers share, and the nats-py reader.

Below `consume` (which picks a reader for `read_ordered` / `read_range`)
and `wire` (the lean reader, which falls back to the nats-py one here). An
`OrderedReader` hands on every message from a sequence, in order, and never one past a
gap: every sequence it hands on goes through `Sequencer.take`, the one place the
checks live. This module does not decode events or decide what a gap costs the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterable
from datetime import UTC, datetime
from typing import Protocol

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext

from services.bus.errors import SequenceGap

# IDLE_HEARTBEAT_S is how often an idle ordered consumer hears from the server. Two missed
# and the consumer is recreated from the next sequence: after a broker restart (which
# forgets ephemeral consumers) a folder resumes in about two of these, not ten seconds.
IDLE_HEARTBEAT_S = 1.0

# BATCH_MAX bounds how many messages one batch holds. Large enough to amortize the
# per-call cost (a SQLite transaction, a span); small enough that a view stays fresh.
BATCH_MAX = 1000


class Delivery:
    """One message as a handler sees it: stream sequence, subject, raw bytes, headers.

    `time` is when the stream stored it. `delivered` counts deliveries of this message to
    this consumer (1 the first time). `pending` is how many matching messages the stream
    held after this one when it was sent.
    """

    __slots__ = ("data", "delivered", "headers", "pending", "seq", "subject", "time_ns")

    def __init__(
        self,
        seq: int,
        subject: str,
        data: bytes,
        headers: dict[str, str] | None = None,
        time_ns: int = 0,
        delivered: int = 1,
        pending: int = 0,
    ) -> None:
        self.seq = seq
        self.subject = subject
        self.data = data
        self.headers = headers
        self.time_ns = time_ns
        self.delivered = delivered
        self.pending = pending

    @property
    def time(self) -> datetime:
        return datetime.fromtimestamp(self.time_ns / 1e9, UTC)

    @property
    def msg_id(self) -> str | None:
        """The event id its `Nats-Msg-Id` carries (without the subject's scope)."""
        header = self.headers.get("Nats-Msg-Id") if self.headers else None
        return header.partition(" ")[2] or header if header else None

    def __repr__(self) -> str:
        return f"Delivery(seq={self.seq}, subject={self.subject!r}, {len(self.data)} bytes)"


def ack_tokens(reply: str) -> tuple[int, int, int, int, int]:
    """(delivered, stream seq, consumer seq, time ns, pending) from a JetStream reply subject.

    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ns>.<pending>` (9 tokens), or
    the newer form with domain and account hash after `ACK` (11 or 12 tokens).
    """
    t = reply.split(".")
    o = 4 if len(t) == 9 else 6
    return int(t[o]), int(t[o + 1]), int(t[o + 2]), int(t[o + 3]), int(t[o + 4])


class OrderedReader(Protocol):
    """Batches of every message from a sequence, in order; `last_seq` is the last stream
    sequence handed on. Implemented by `NatsOrderedReader` and `wire.WireOrderedReader`."""

    @property
    def last_seq(self) -> int: ...

    def batches(self) -> AsyncGenerator[list[Delivery], None]: ...


# Item is one message as a reader parsed it, for `Sequencer.take`: (stream seq, consumer
# seq, stored time ns, pending, subject, data, headers). A stream seq of 0 is a heartbeat
# saying the consumer has sent up to its consumer seq.
Item = tuple[int, int, int, int, str, bytes, dict[str, str] | None]


class Sequencer:
    """The sequence checks of an ordered read, shared by both readers.

    Every consumer sequence must follow the one before (a new consumer starts again at 1
    from our next stream sequence); a stream sequence already handed on is skipped (sent
    again after a consumer reset); without a filter every stream sequence must follow the
    one before, or `SequenceGap` is raised: that loss is the stream's, and no new consumer
    can bring it back. It stops at `until_seq`, and with `to_end` at the message the
    stream says is its last (pending 0).
    """

    __slots__ = ("done", "last_dseq", "last_seq", "strict", "to_end", "until_seq")

    def __init__(self, from_seq: int, *, strict: bool, until_seq: int | None, to_end: bool):
        self.last_seq = from_seq - 1
        self.last_dseq = 0
        self.strict = strict
        self.until_seq = until_seq
        self.to_end = to_end
        self.done = False

    def take(self, items: Iterable[Item]) -> tuple[list[Delivery], SequenceGap | None]:
        """The deliveries of `items` up to the end, `until_seq` or a consumer-sequence gap,
        and that gap (not raised: the wire reader recreates its consumer, the nats-py
        reader raises it)."""
        out: list[Delivery] = []
        append = out.append
        last_seq, last_dseq = self.last_seq, self.last_dseq
        until = self.until_seq
        strict, to_end = self.strict, self.to_end
        gap = None
        for sseq, dseq, ns, pending, subject, data, headers in items:
            if sseq == 0:
                if dseq > last_dseq:
                    gap = SequenceGap(last_dseq + 1, dseq, "heartbeat-reported consumer sequence")
                    break
                continue
            if dseq != last_dseq + 1 and not (dseq == 1 and sseq > last_seq):
                gap = SequenceGap(last_dseq + 1, dseq, "consumer sequence")
                break
            last_dseq = dseq
            if sseq <= last_seq:
                continue
            if strict and sseq != last_seq + 1:
                self.last_seq, self.last_dseq = last_seq, last_dseq
                raise SequenceGap(last_seq + 1, sseq)
            if until is not None and sseq > until:
                self.done = True
                break
            append(Delivery(sseq, subject, data, headers, ns, 1, pending))
            last_seq = sseq
            if (until is not None and sseq >= until) or (to_end and pending == 0):
                self.done = True
                break
        self.last_seq, self.last_dseq = last_seq, last_dseq
        return out, gap


class NatsOrderedReader:
    """An ordered push consumer of nats-py whose callback only appends to a list.

    nats-py answers flow control on arrival, not after the callback: a callback that
    awaits lets its queue pass the pending limit and drop messages, telling only
    error_cb. Ours never awaits; the folding happens in the task that drains the list.
    nats-py recreates the consumer itself on missed heartbeats (its consumer sequence
    starts again at 1); any other consumer-sequence gap is raised as `SequenceGap`.
    """

    def __init__(
        self,
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
    ) -> None:
        self.js = js
        self.from_seq = max(1, from_seq)
        self.filter_subject = filter_subject
        self.stream = stream
        self.to_end = to_end
        self.stop = stop
        self.batch_max = batch_max
        # name: the one consumer name a reader confined by permissions may use (an agent,
        # see `consume.read_range`); None gives each consumer a name of its own.
        self.name = consumer
        self.seq = Sequencer(
            self.from_seq, strict=filter_subject is None, until_seq=until_seq, to_end=to_end
        )
        self._buf: list[Msg] = []
        self._wake = asyncio.Event()

    @property
    def last_seq(self) -> int:
        return self.seq.last_seq

    async def _on_msg(self, msg: Msg) -> None:
        # Invariant: no await here (see the class docstring).
        self._buf.append(msg)
        self._wake.set()

    async def batches(self) -> AsyncGenerator[list[Delivery], None]:
        if not await start(self.js, self.seq, self.stream, self.filter_subject):
            return
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.seq.last_seq + 1,
            name=self.name,
        )
        if self.name:
            # A consumer's start cannot be changed: one a dead reader left goes first.
            with contextlib.suppress(nats.errors.Error):
                await self.js.delete_consumer(self.stream, self.name)
        sub = await self.js.subscribe(
            self.filter_subject or ">",
            stream=self.stream,
            cb=self._on_msg,
            ordered_consumer=True,
            idle_heartbeat=IDLE_HEARTBEAT_S,
            config=config,
        )
        stopper: asyncio.Task[bool] | None = None
        try:
            if self.stop is not None:
                stopper = asyncio.create_task(self.stop.wait())
                stopper.add_done_callback(lambda _: self._wake.set())
            if self.to_end:
                ci = await sub.consumer_info()
                if ci.num_pending == 0 and not (ci.delivered and ci.delivered.consumer_seq):
                    return  # nothing matches: nothing was sent, nothing will be
            while not self.seq.done:
                if not self._buf:
                    if self.stop is not None and self.stop.is_set():
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                msgs, self._buf = self._buf, []
                for i in range(0, len(msgs), self.batch_max):
                    out = self.check(msgs[i : i + self.batch_max])
                    if out:
                        yield out
                    if self.seq.done:
                        break
        finally:
            if stopper is not None:
                stopper.cancel()
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
            if self.name:
                with contextlib.suppress(nats.errors.Error):
                    await self.js.delete_consumer(self.stream, self.name)

    def check(self, msgs: list[Msg]) -> list[Delivery]:
        """The deliveries of `msgs` that `Sequencer.take` lets through; a gap raises."""
        items: list[Item] = []
        for msg in msgs:
            t = msg.reply.split(".")
            o = 4 if len(t) == 9 else 6
            items.append(
                (
                    int(t[o + 1]),
                    int(t[o + 2]),
                    int(t[o + 3]),
                    int(t[o + 4]),
                    msg.subject,
                    msg.data,
                    msg.headers,
                )
            )
        out, gap = self.seq.take(items)
        if gap is not None:
            raise gap
        return out


async def start(
    js: JetStreamContext, seq: Sequencer, stream: str, filter_subject: str | None
) -> bool:
    """Bring `seq` to the stream as it is now: past its first sequence (a store restored
    from later on starts there; the log never deletes), and with `to_end` to its last.
    False when there is nothing to read."""
    info = await js.stream_info(stream)
    first = info.state.first_seq or 1
    if filter_subject is None and seq.last_seq + 1 < first:
        seq.last_seq = first - 1
    from_seq = seq.last_seq + 1
    if seq.to_end:
        end = info.state.last_seq
        seq.until_seq = end if seq.until_seq is None else min(seq.until_seq, end)
    return seq.until_seq is None or seq.until_seq >= from_seq
