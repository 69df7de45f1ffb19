"""NATS plumbing for llmgw: the embedded broker, connecting, the streams, publishing and
the consume loops, with trace context carried in message headers.

Services and the CLI import from here; `services.core` never does (it does no I/O).
"""

from services.bus.broker import EmbeddedBroker, find_binary, free_port, read_url, write_url
from services.bus.connection import connect, resolve_url
from services.bus.errors import (
    BrokerError,
    BrokerRefused,
    BrokerUnavailable,
    BrokerUntrusted,
    BusError,
    LogHole,
    Permanent,
    PublishError,
    Retry,
    SequenceGap,
    Unanswered,
)
from services.bus.publish import Published, Publisher
from services.bus.stream import DLQ_STREAM, ensure_dlq_stream, ensure_stream, ensure_streams

__all__ = [
    "DLQ_STREAM",
    "BrokerError",
    "BrokerRefused",
    "BrokerUnavailable",
    "BrokerUntrusted",
    "BusError",
    "EmbeddedBroker",
    "LogHole",
    "Permanent",
    "PublishError",
    "Published",
    "Publisher",
    "Retry",
    "SequenceGap",
    "Unanswered",
    "connect",
    "ensure_dlq_stream",
    "ensure_stream",
    "ensure_streams",
    "find_binary",
    "free_port",
    "read_url",
    "resolve_url",
    "write_url",
]
