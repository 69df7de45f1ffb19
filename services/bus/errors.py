"""Errors of the bus: one base class, data kept as fields.

Raised by `services.bus` (connect, broker, consume loops) and by handlers that run under
the consume loops, which read `Retry` and `Permanent` to decide between a delayed
redelivery and the dead-letter queue. This module does no I/O.
"""

from __future__ import annotations

from services.bus.urls import public_url


class BusError(Exception):
    """Base of every error `services.bus` raises or understands."""


class BrokerUnavailable(BusError):
    """No NATS server answered at `url`.

    Its message is the one line a user sees: where we looked and how to get a broker.
    """

    def __init__(self, url: str, why: str | None = None) -> None:
        self.url = url
        self.why = why
        detail = f" ({why})" if why else ""
        super().__init__(
            f"no NATS server answers at {public_url(url)}{detail}: start one with `llmgw up`, "
            "or point at a running one with --nats URL or LLMGW_NATS"
        )


class BrokerRefused(BusError):
    """A NATS server answered at `url` and refused the credentials given (or their lack).

    Not a `BrokerUnavailable`: the server is there, and starting another will not help.
    """

    def __init__(self, url: str, why: str | None = None) -> None:
        self.url = url
        self.why = why
        detail = f" ({why})" if why else ""
        super().__init__(
            f"the NATS server at {public_url(url)} refused the credentials{detail}: check "
            "the user and password (or token) of the URL given with --nats or LLMGW_NATS, "
            "or the data directory's broker.password"
        )


class BrokerUntrusted(BusError):
    """A NATS server answered at `url` and the client does not trust it: its certificate
    does not verify against the CA given (`ca`, or the system's), or it offers no TLS to a
    client told to use it. Nothing was sent to it: no credentials, no events.
    """

    def __init__(self, url: str, why: str, ca: str | None = None) -> None:
        self.url = url
        self.why = why
        self.ca = ca
        against = f"the CA in {ca}" if ca else "the system's CAs"
        super().__init__(
            f"the NATS server at {public_url(url)} is not trusted ({why}; checked against "
            f"{against}): give the CA that signed its certificate with --nats-ca FILE or "
            "LLMGW_NATS_CA, and connect by the name its certificate holds"
        )


class BrokerError(BusError):
    """The embedded nats-server could not be found, started or stopped."""

    def __init__(self, why: str, log: str | None = None) -> None:
        self.why = why
        self.log = log
        super().__init__(f"{why} (log: {log})" if log else why)


class StreamConflict(BusError):
    """The broker's event stream belongs to another root; nothing was changed."""

    def __init__(self, stream: str, theirs: str, root: str) -> None:
        self.stream, self.theirs, self.root = stream, theirs, root
        super().__init__(
            f"stream {stream} on this broker holds the log of root {theirs}, not {root}: "
            f"use --root {theirs}, or another broker for root {root}"
        )


class PublishError(BusError):
    """JetStream did not take a message on `subject`: no stream, no ack in time, refused.

    Retrying is safe: the message id makes a second copy a duplicate.
    """

    def __init__(self, subject: str, why: str) -> None:
        self.subject = subject
        self.why = why
        super().__init__(f"publish to {subject} failed: {why}")


class Retry(BusError):
    """A handler's temporary failure: redeliver the message after `delay_s` seconds.

    Use it for what may succeed later (a dependency not ready yet); the consumer's
    `max_deliver` bounds how often, after which the message is dead-lettered.
    """

    def __init__(self, delay_s: float = 1.0, reason: str = "retry requested") -> None:
        self.delay_s = delay_s
        self.reason = reason
        super().__init__(f"{reason} (retry in {delay_s:g}s)")


class Unanswered(BusError):
    """The broker did not answer a request in time (a server busy, or one of a cluster
    stopping under it): the same request may well be answered later. A refusal is not
    one of these."""


class Permanent(BusError):
    """A handler's permanent failure: the message can never succeed.

    It is recorded on the consumer's dead-letter subject with `reason` and acked, so the
    loop goes on.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class SequenceGap(BusError):
    """An ordered read skipped stream messages: `expected` was due, `got` arrived.

    A folder that sees it must not apply `got`; it restarts from its checkpoint. Silent
    loss is the one failure an event-sourced view cannot recover from later.
    """

    def __init__(self, expected: int, got: int, what: str = "stream sequence") -> None:
        self.expected = expected
        self.got = got
        self.what = what
        super().__init__(f"{what} gap: expected {expected}, got {got}")


class StreamReplaced(BusError):
    """The stream a reader was following is not the one there now: deleted and created
    again, or another cluster's. A view folded from the old one must not read on in the
    new one (its sequences mean other events): it is rebuilt from the new log."""

    def __init__(self, stream: str, was: str, now: str) -> None:
        self.stream = stream
        self.was = was
        self.now = now
        super().__init__(
            f"stream {stream} was replaced (it was created {was}, the one there now {now})"
        )


class LogHole(BusError):
    """Stream message `seq` is gone from the log (deleted), so no view can be folded past
    it. Folding on would build a view no replay agrees with; an operator must restore the
    message (or the stream) first."""

    def __init__(self, seq: int, stream: str) -> None:
        self.seq = seq
        self.stream = stream
        super().__init__(
            f"message {seq} of stream {stream} is missing from the log (deleted?): "
            "the view cannot be folded past it; restore the stream from a backup"
        )
