"""Publishing events to the stream, with their id as `Nats-Msg-Id` and the trace context.

Used by every service that records a fact or a decision, by `llmgw events publish` and
`import`, and by benchmarks (`publish_many`). Every publish waits for JetStream's ack: a
plain core-NATS publish onto a stream subject can be dropped under load and nobody is told.

In a cluster, a publish that meets an election (no ack in time, JetStream unavailable, no
stream leader answering) is sent again with the same `Nats-Msg-Id` until `retry_s` has
passed: the server's duplicate window makes the retry of a publish that was in fact
stored a no-op, so the event is stored once.

Message ids are scoped by subject (`scoped_id`): `<subject> <event id>`, so one
publisher's ids are not another's. The server's duplicate check is by id alone, and
anyone may send any id in the header, so a duplicate ack is not believed either: the
message stored at its sequence must be on this publish's subject (`StoredAt`), or the id
was taken by someone else's message, which is said (one line, `COLLISIONS`) and the
event published again under a fresh id. A real event is never kept off the log by a
message it did not send.

Where the log takes a node's reports through the node's own stream (services.bus.stream),
the log's duplicate check also meets ids from every node's stream, where no duplicate
ack comes back to check. A publisher of a node's reports then seals its ids (`seal`):
`<subject> <event id> <seal>`, the seal a random string of this publisher's, which no
other node sees, so no other can send an id first that keeps its report off the log.

A stream at its limits (a node's, when its agent flooded it) refuses a message with a 503
as an election does, but asking again is refused the same way: that is a `PublishError`
at once ("the stream is full"), not retried.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections import Counter
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
from services.bus import stream, tracing
from services.bus.errors import PublishError

log = logging.getLogger("llmgw.bus")

MSG_ID = "Nats-Msg-Id"

# COLLISIONS counts, per subject, the publishes in this process whose message id another
# message had taken (a duplicate ack for a message on another subject), for tests and
# status. Each one is also one error line, and the event was stored again.
COLLISIONS: Counter[str] = Counter()

# StoredAt says which subject the message at (stream, seq) is on: None when it cannot
# be read (then a duplicate ack is believed, as before scoping), `OTHER` when it is one
# the reader may not see.
StoredAt = Callable[[str, int], Awaitable[str | None]]
OTHER = "(a subject this publisher cannot read)"


def scoped_id(subject: str, msg_id: str) -> str:
    """The `Nats-Msg-Id` of message id `msg_id` published on `subject`. A subject holds
    no space, so the id is everything after the first one (`event_id`)."""
    return f"{subject} {msg_id}"


def event_id(header: str) -> str:
    """The event id a `Nats-Msg-Id` carries: scoped (`scoped_id`, sealed or not) or, in
    logs written before ids were scoped, the id itself."""
    return header.partition(" ")[2].partition(" ")[0] or header


def new_seal() -> str:
    """A publisher's seal (`Publisher.seal`): 16 random bytes, hex."""
    return secrets.token_hex(16)


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
    bounded: bool = False,
) -> T:
    """`call()`, made again every RETRY_PAUSE_S while it fails as an election makes things
    fail (`retry(error)`), until `retry_s` has passed; then its last error is raised.
    The one rule for riding out an election: a publish's, and that of the reads an
    operator command makes before it publishes. `on_first` hears the first failure.
    `bounded`: a try still waiting at the deadline is cut off there (`TimeoutError`), for
    a call that waits of its own accord (a log reader reconnecting) rather than fail."""
    deadline = time.monotonic() + retry_s
    tries = 0
    while True:
        tries += 1
        try:
            if not bounded:
                return await call()
            # wait_for runs the try as a task of its own and cancels that one: a timeout
            # context on this task could leave its cancel pending past a try that failed
            # at the deadline, for the caller's next await to meet.
            return await asyncio.wait_for(call(), max(deadline - time.monotonic(), RETRY_PAUSE_S))
        except Exception as e:
            if not retry(e) or time.monotonic() + RETRY_PAUSE_S >= deadline:
                raise
            if tries == 1 and on_first is not None:
                on_first(e)
        await asyncio.sleep(RETRY_PAUSE_S)


def full(e: BaseException) -> str:
    """The reason of a `PublishError` for a stream's refusal at its limits."""
    said = getattr(e, "description", None) or str(e)
    return f"the stream is full ({said}): refused until older messages age out"


@dataclass(frozen=True, slots=True)
class Published:
    """What JetStream said: the stream sequence, and whether it was a duplicate it dropped
    (then `seq` is the sequence of the copy stored first)."""

    seq: int
    duplicate: bool
    subject: str
    stream: str = ""
    """The stream that stored it (empty where the ack did not say)."""


RawItem = tuple[str, bytes, str | None]


class Publisher:
    """Publishes events under `root` on one JetStream context."""

    def __init__(
        self,
        js: JetStreamContext,
        root: str = subjects.DEFAULT_ROOT,
        *,
        retry_s: float = ELECTION_RETRY_S,
        stored_at: StoredAt | None = None,
    ) -> None:
        self.js = js
        self.root = root
        self.retry_s = retry_s
        self._stored_at = stored_at or self._get_subject
        """Where a duplicate ack's message is looked up: by default the stream's message
        get (the control role's); an agent reads through its own consumer."""
        """How long a publish is retried through an election; 0: tried once."""
        self._retryable = retryable(js)
        self.seal: str | None = None
        """Appended to every message id when set (`new_seal`): for a publisher of a
        node's reports where the log takes them through node streams."""

    def msg_id(self, subject: str, event_id: str) -> str:
        """The `Nats-Msg-Id` of `event_id` on `subject`: scoped, and sealed if `seal`."""
        scoped = scoped_id(subject, event_id)
        return f"{scoped} {self.seal}" if self.seal else scoped

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
            headers = tracing.inject({MSG_ID: self.msg_id(subj, event.id)})
            out = await self.own(subj, body, headers, await self._publish(subj, body, headers))
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
            hdr[MSG_ID] = self.msg_id(subject, msg_id)
        tracing.inject(hdr)
        return await self.own(subject, body, hdr, await self._publish(subject, body, hdr or None))

    async def own(
        self, subject: str, body: bytes, headers: dict[str, str], out: Published
    ) -> Published:
        """`out`, once a duplicate ack is shown to be of this publisher's own message;
        else the message published again under a fresh id, and that said. For a caller
        that sent `body` with `headers` itself (pipelined dead letters)."""
        if not out.duplicate or MSG_ID not in headers:
            return out
        stored = await self._stored_at(out.stream, out.seq)
        if stored is None or stored == subject:
            return out
        COLLISIONS[subject] += 1
        taken = headers[MSG_ID]
        fresh = {**headers, MSG_ID: f"{taken} {uuid.uuid4().hex}"}
        again = await self._publish(subject, body, fresh)
        log.error(
            "publish on %s: message id %r was taken by seq %d on %s, not this event; "
            "stored again at seq %d under a fresh id",
            subject,
            event_id(taken),
            out.seq,
            stored,
            again.seq,
        )
        return again

    async def _get_subject(self, stream: str, seq: int) -> str | None:
        if not stream:
            return None
        try:
            msg = await self.js.get_msg(stream, seq)
        except (nats.errors.Error, TimeoutError) as e:
            log.warning("duplicate ack for seq %d of %s not checked: %s", seq, stream, e)
            return None
        return msg.subject

    async def _publish(
        self, subject: str, body: bytes, headers: dict[str, str] | None
    ) -> Published:
        def retry(e: BaseException) -> bool:
            # Without a message id a retry could store the event twice.
            return (
                isinstance(e, PublishError)
                and isinstance(e.__cause__, self._retryable)
                and not stream.is_full(e.__cause__)
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
        except nats.js.errors.APIError as e:
            if stream.is_full(e):
                raise PublishError(subject, full(e)) from e
            raise PublishError(subject, str(e) or type(e).__name__) from e
        except nats.errors.TimeoutError as e:
            raise PublishError(subject, "no ack from JetStream in time") from e
        except (nats.errors.Error, ConnectionError) as e:
            raise PublishError(subject, str(e) or type(e).__name__) from e
        return Published(
            seq=ack.seq, duplicate=bool(ack.duplicate), subject=subject, stream=ack.stream or ""
        )

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
                    hdr[MSG_ID] = self.msg_id(subj, msg_id)
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
                if not isinstance(ack, self._retryable) or self.retry_s <= 0 or stream.is_full(ack):
                    why = (
                        "no stream stores this subject"
                        if isinstance(ack, nats.js.errors.NoStreamResponseError)
                        else full(ack)
                        if stream.is_full(ack)
                        else (str(ack) or type(ack).__name__)
                    )
                    raise PublishError(sent.subject, why) from ack
                # An election: this one and every later one of the window again, in
                # order, each with its own id. Those stored already come back as
                # duplicates with the sequence they were stored at.
                for again in pending[i:]:
                    out.append(await self._publish(again.subject, again.body, again.headers))
                break
            one = Published(
                seq=ack.seq,
                duplicate=bool(ack.duplicate),
                subject=sent.subject,
                stream=ack.stream or "",
            )
            out.append(await self.own(sent.subject, sent.body, sent.headers or {}, one))
        return out


@dataclass(frozen=True, slots=True)
class _Sent:
    """One message of a window in flight: what to send again if the ack does not come."""

    subject: str
    body: bytes
    headers: dict[str, str] | None
    ack: asyncio.Future[PubAck]
