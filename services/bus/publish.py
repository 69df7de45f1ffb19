"""Publishing events to the stream, with their id as `Nats-Msg-Id` and the trace context.

Used by every service that records a fact or a decision, by `llmgw events publish` and
`import`, and by benchmarks (`publish_many`). Every publish waits for JetStream's ack: a
plain core-NATS publish onto a stream subject can be dropped under load and nobody is told.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js.api import PubAck
from nats.js.client import JetStreamContext
from opentelemetry import trace

from schemas import codec, subjects
from schemas.events import Envelope
from services.bus import tracing
from services.bus.errors import PublishError

MSG_ID = "Nats-Msg-Id"

# PUBLISH_WINDOW is how many publishes publish_many keeps in flight before it waits for
# their acks. Measured on 2 cores: past a few thousand the rate stops rising and only the
# memory for unacked messages grows.
PUBLISH_WINDOW = 2000

# ACK_TIMEOUT_S bounds the wait for a window's acks. nats-py's async publish futures have
# no timeout of their own, so a broker that dies mid-window would hang the caller forever.
ACK_TIMEOUT_S = 10.0


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

    def __init__(self, js: JetStreamContext, root: str = subjects.DEFAULT_ROOT) -> None:
        self.js = js
        self.root = root

    async def publish(
        self, event: Envelope, *, subject: str | None = None, node: str | None = None
    ) -> Published:
        """Publish one event on its subject (or `subject`) and wait for the ack."""
        subj = subject or subjects.subject_for(event, self.root, node)
        body = codec.encode(event)
        with tracing.tracer().start_as_current_span(
            f"send {subj}",
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
        try:
            ack = await self.js.publish(subject, body, headers=headers)
        except nats.js.errors.NoStreamResponseError as e:
            raise PublishError(subject, "no stream stores this subject") from e
        except nats.errors.TimeoutError as e:
            raise PublishError(subject, "no ack from JetStream in time") from e
        except nats.errors.Error as e:
            raise PublishError(subject, str(e) or type(e).__name__) from e
        return Published(seq=ack.seq, duplicate=bool(ack.duplicate), subject=subject)

    async def publish_many(
        self,
        items: Iterable[Envelope] | Iterable[RawItem],
        *,
        window: int = PUBLISH_WINDOW,
        node: str | None = None,
    ) -> list[Published]:
        """Publish many events (or `(subject, body, msg_id)` tuples) pipelined, in order.

        Each window of `window` messages is sent without waiting, then its acks are
        awaited. Order on the stream is the order given: one connection, one writer.
        Raises `PublishError` at the first failed message; the ones before it are stored,
        and publishing the same items again is safe (their ids make them duplicates).
        """
        out: list[Published] = []
        pending: list[tuple[str, asyncio.Future[PubAck]]] = []
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
            for item in items:
                msg_id: str | None
                if isinstance(item, Envelope):
                    subj = subjects.subject_for(item, self.root, node)
                    body, msg_id = codec.encode(item), item.id
                else:
                    subj, body, msg_id = item
                hdr = dict(trace_headers)
                if msg_id is not None:
                    hdr[MSG_ID] = msg_id
                fut = await self.js.publish_async(subj, body, headers=hdr or None)
                pending.append((subj, fut))
                if len(pending) >= window:
                    out.extend(await self._settle(pending))
                    pending = []
            if pending:
                out.extend(await self._settle(pending))
            span.set_attribute("messaging.batch.message_count", len(out))
        return out

    async def _settle(self, pending: list[tuple[str, asyncio.Future[PubAck]]]) -> list[Published]:
        futures = [f for _, f in pending]
        try:
            acks = await asyncio.wait_for(
                asyncio.gather(*futures, return_exceptions=True), ACK_TIMEOUT_S
            )
        except TimeoutError as e:
            for f in futures:
                f.cancel()
            raise PublishError(
                pending[0][0], f"no ack for a window within {ACK_TIMEOUT_S:g}s"
            ) from e
        out = []
        for (subj, _), ack in zip(pending, acks, strict=True):
            if isinstance(ack, BaseException):
                why = (
                    "no stream stores this subject"
                    if isinstance(ack, nats.js.errors.NoStreamResponseError)
                    else (str(ack) or type(ack).__name__)
                )
                raise PublishError(subj, why) from ack
            out.append(Published(seq=ack.seq, duplicate=bool(ack.duplicate), subject=subj))
        return out
