"""Publishing events to the stream, with their id as `Nats-Msg-Id` and the trace context.

Used by every service that records a fact or a decision, by `llmgw events publish` and
`import`, and by benchmarks (`publish_many`). Every publish waits for JetStream's ack: a
plain core-NATS publish onto a stream subject can be dropped under load and nobody is told.

In a cluster, a publish that meets an election (no ack in time, JetStream unavailable, no
stream leader answering) is sent again with the same `Nats-Msg-Id` until `retry_s` has
passed: the server's duplicate window makes the retry of a publish that was in fact
stored a no-op, so the event is stored once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.js.api import PubAck
from nats.js.client import JetStreamContext
from opentelemetry import context as otel_context
from opentelemetry import trace

from schemas import codec, subjects
from schemas.events import Envelope
from services.bus import tracing
from services.bus.errors import PublishError

log = logging.getLogger("llmgw.bus")

MSG_ID = "Nats-Msg-Id"

# ELECTION_RETRY_S is how long a publish is retried while the stream has no leader. A
# three-server cluster elects a new one within a few seconds of losing one; twice the
# server's own election timeouts leaves room for a slow machine, and stays well inside
# the duplicate window (2 min) that makes the retries harmless.
ELECTION_RETRY_S = 30.0

# RETRY_PAUSE_S is the pause between two tries during an election.
RETRY_PAUSE_S = 0.25

# RETRYABLE are the errors of a publish that may be stored on a later try: no ack in
# time (the leader died, or the ack was lost), JetStream unavailable (503: no leader
# yet), and a connection lost or being reconnected to another server.
RETRYABLE: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.js.errors.ServiceUnavailableError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionClosedError,
    ConnectionError,
)

# RETRYABLE_IN_A_CLUSTER adds "no stream stores this subject": in a cluster it is also
# what a subject says while its stream has no leader, measured after a kill -9 of the
# leader. On a single server it means the stream is missing, and waiting makes none.
RETRYABLE_IN_A_CLUSTER = (*RETRYABLE, nats.js.errors.NoStreamResponseError)

# PUBLISH_WINDOW is how many publishes publish_many keeps in flight before it waits for
# their acks. Measured on 2 cores: past a few thousand the rate stops rising and only the
# memory for unacked messages grows.
PUBLISH_WINDOW = 2000

# ACK_TIMEOUT_S bounds the wait for a window's acks. nats-py's async publish futures have
# no timeout of their own, so a broker that dies mid-window would hang the caller forever.
ACK_TIMEOUT_S = 10.0


T = TypeVar("T")


def retryable(js: JetStreamContext) -> tuple[type[BaseException], ...]:
    """The errors an election gives a client of `js`: RETRYABLE, or RETRYABLE_IN_A_CLUSTER
    when its connection names more than one server."""
    target = getattr(js, "target", None)
    clustered = target is not None and len(target.servers) > 1
    return RETRYABLE_IN_A_CLUSTER if clustered else RETRYABLE


async def ride_out(
    call: Callable[[], Awaitable[T]],
    retry: Callable[[BaseException], bool],
    *,
    retry_s: float = ELECTION_RETRY_S,
    on_first: Callable[[BaseException], None] | None = None,
) -> T:
    """`call()`, made again every RETRY_PAUSE_S while it fails as an election makes things
    fail (`retry(error)`), until `retry_s` has passed; then its last error is raised.
    The one rule for riding out an election: a publish's, and that of the reads an
    operator command makes before it publishes. `on_first` hears the first failure."""
    deadline = time.monotonic() + retry_s
    tries = 0
    while True:
        tries += 1
        try:
            return await call()
        except Exception as e:
            if not retry(e) or time.monotonic() + RETRY_PAUSE_S >= deadline:
                raise
            if tries == 1 and on_first is not None:
                on_first(e)
        await asyncio.sleep(RETRY_PAUSE_S)


@dataclass(frozen=True, slots=True)
class Published:
    """What JetStream said: the stream sequence, and whether it was a duplicate it dropped
    (then `seq` is the sequence of the copy stored first)."""

    seq: int
    duplicate: bool
    subject: str


RawItem = tuple[str, bytes, str | None]


class Publisher:
    """Publishes events under `root` on one JetStream context."""

    def __init__(
        self,
        js: JetStreamContext,
        root: str = subjects.DEFAULT_ROOT,
        *,
        retry_s: float = ELECTION_RETRY_S,
    ) -> None:
        self.js = js
        self.root = root
        self.retry_s = retry_s
        """How long a publish is retried through an election; 0: tried once."""
        self._retryable = retryable(js)

    async def publish(
        self, event: Envelope, *, subject: str | None = None, node: str | None = None
    ) -> Published:
        """Publish one event on its subject (or `subject`) and wait for the ack."""
        subj = subject or subjects.subject_for(event, self.root, node)
        body = codec.encode(event)
        parent = None
        if event.causation and not trace.get_current_span().get_span_context().is_valid:
            # Published outside any handler: the trace is the one of what it reacts to.
            parent = tracing.recalled(event.causation)
        with tracing.tracer().start_as_current_span(
            f"send {subj}",
            context=parent,
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "messaging.system": tracing.SYSTEM,
                "messaging.destination.name": subj,
                "messaging.message.id": event.id,
                "messaging.operation.type": "send",
                "messaging.operation.name": "publish",
                "messaging.message.body.size": len(body),
            },
        ) as span:
            headers = tracing.inject({MSG_ID: event.id})
            out = await self._publish(subj, body, headers)
            span.set_attribute("messaging.nats.stream.sequence", out.seq)
            if out.duplicate:
                span.set_attribute("messaging.nats.duplicate", True)
            return out

    async def publish_raw(
        self,
        subject: str,
        body: bytes,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Published:
        """Publish bytes as they are (imports, tests of bad input) and wait for the ack."""
        hdr = dict(headers or {})
        if msg_id is not None:
            hdr[MSG_ID] = msg_id
        tracing.inject(hdr)
        return await self._publish(subject, body, hdr or None)

    async def _publish(
        self, subject: str, body: bytes, headers: dict[str, str] | None
    ) -> Published:
        def retry(e: BaseException) -> bool:
            # Without a message id a retry could store the event twice.
            return (
                isinstance(e, PublishError)
                and isinstance(e.__cause__, self._retryable)
                and MSG_ID in (headers or {})
            )

        def said(e: BaseException) -> None:
            why = e.why if isinstance(e, PublishError) else str(e)
            log.info("publish on %s: %s; retrying with the same id", subject, why)

        return await ride_out(
            lambda: self._publish_once(subject, body, headers),
            retry,
            retry_s=self.retry_s,
            on_first=said,
        )

    async def _publish_once(
        self, subject: str, body: bytes, headers: dict[str, str] | None
    ) -> Published:
        try:
            ack = await self.js.publish(subject, body, headers=headers)
        except nats.js.errors.NoStreamResponseError as e:
            raise PublishError(subject, "no stream stores this subject") from e
        except nats.errors.TimeoutError as e:
            raise PublishError(subject, "no ack from JetStream in time") from e
        except (nats.errors.Error, ConnectionError) as e:
            raise PublishError(subject, str(e) or type(e).__name__) from e
        return Published(seq=ack.seq, duplicate=bool(ack.duplicate), subject=subject)

    async def publish_many(
        self,
        items: Iterable[Envelope] | Iterable[RawItem],
        *,
        window: int = PUBLISH_WINDOW,
        node: str | None = None,
        parent_of: Callable[[int], otel_context.Context | None] | None = None,
    ) -> list[Published]:
        """Publish many events (or `(subject, body, msg_id)` tuples) pipelined, in order.

        Each window of `window` messages is sent without waiting, then its acks are
        awaited. Order on the stream is the order given: one connection, one writer.
        Raises `PublishError` at the first failed message; the ones before it are stored,
        and publishing the same items again is safe (their ids make them duplicates).

        `parent_of(i)`, when given and not None, is the trace item i joins: it gets a
        PRODUCER span of its own there (a reaction in the trace of what it reacts to),
        instead of the batch's span. It is asked as item i is sent, when the items before
        it are remembered (`tracing.remember`), so a reaction to an event of the same
        batch finds its trace.
        """
        out: list[Published] = []
        pending: list[_Sent] = []
        with tracing.tracer().start_as_current_span(
            "send batch",
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "messaging.system": tracing.SYSTEM,
                "messaging.operation.type": "send",
                "messaging.operation.name": "publish",
            },
        ) as span:
            trace_headers = tracing.inject({}) if span.is_recording() else {}
            given: Iterable[Envelope | RawItem] = items
            for i, item in enumerate(given):
                msg_id: str | None
                if isinstance(item, Envelope):
                    subj = subjects.subject_for(item, self.root, node)
                    body, msg_id = codec.encode(item), item.id
                else:
                    subj, body, msg_id = item
                parent = parent_of(i) if parent_of is not None else None
                if parent is not None and span.is_recording():
                    hdr = self._own_span(subj, msg_id, parent)
                    tracing.remember(0, hdr, msg_id)
                else:
                    hdr = dict(trace_headers)
                if msg_id is not None:
                    hdr[MSG_ID] = msg_id
                fut = await self.js.publish_async(subj, body, headers=hdr or None)
                pending.append(_Sent(subj, body, hdr or None, fut))
                if len(pending) >= window:
                    out.extend(await self._settle(pending))
                    pending = []
            if pending:
                out.extend(await self._settle(pending))
            span.set_attribute("messaging.batch.message_count", len(out))
        return out

    def _own_span(
        self, subject: str, msg_id: str | None, parent: otel_context.Context
    ) -> dict[str, str]:
        """Headers carrying a PRODUCER span for one message, a child of `parent`."""
        one = tracing.tracer().start_span(
            f"send {subject}",
            context=parent,
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "messaging.system": tracing.SYSTEM,
                "messaging.destination.name": subject,
                "messaging.message.id": msg_id or "",
                "messaging.operation.type": "send",
                "messaging.operation.name": "publish",
            },
        )
        try:
            return tracing.inject({}, trace.set_span_in_context(one))
        finally:
            one.end()

    async def _settle(self, pending: list[_Sent]) -> list[Published]:
        futures = [p.ack for p in pending]
        try:
            acks: list[PubAck | BaseException] = await asyncio.wait_for(
                asyncio.gather(*futures, return_exceptions=True), ACK_TIMEOUT_S
            )
        except TimeoutError:
            for f in futures:
                f.cancel()
            acks = [nats.errors.TimeoutError() for _ in pending]
        out = []
        for i, (sent, ack) in enumerate(zip(pending, acks, strict=True)):
            if isinstance(ack, BaseException):
                if not isinstance(ack, self._retryable) or self.retry_s <= 0:
                    why = (
                        "no stream stores this subject"
                        if isinstance(ack, nats.js.errors.NoStreamResponseError)
                        else (str(ack) or type(ack).__name__)
                    )
                    raise PublishError(sent.subject, why) from ack
                # An election: this one and every later one of the window again, in
                # order, each with its own id. Those stored already come back as
                # duplicates with the sequence they were stored at.
                for again in pending[i:]:
                    out.append(await self._publish(again.subject, again.body, again.headers))
                break
            out.append(Published(seq=ack.seq, duplicate=bool(ack.duplicate), subject=sent.subject))
        return out


@dataclass(frozen=True, slots=True)
class _Sent:
    """One message of a window in flight: what to send again if the ack does not come."""

    subject: str
    body: bytes
    headers: dict[str, str] | None
    ack: asyncio.Future[PubAck]
