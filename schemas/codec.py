"""Encoding and decoding of events: one Decoder and one Encoder, built once, reused.

Used by every publisher and consumer, by bundles and by the fold's callers. Decoding is
the single place where raw bytes become trusted events; anything that fails here is
reported as an `EventDecodeError` naming the field and the reason, never a bare msgspec
exception.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from schemas.errors import EventDecodeError
from schemas.events import EVENT_TYPES, Envelope, Event

# MAX_EVENT_BYTES bounds one event. The largest honest event (a preemption decision with
# every candidate listed) is a few tens of KiB; past this it is garbage or an attack, and
# NATS's own default max payload is 1 MiB.
MAX_EVENT_BYTES = 256 * 1024

_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)
_encoder = msgspec.json.Encoder()
_AT = re.compile(r"^(?P<why>.*?) - at `(?P<path>[^`]*)`$", re.S)
_TYPE_PEEK = msgspec.json.Decoder(dict[str, Any])


def encode(event: Envelope) -> bytes:
    """The canonical JSON of an event (the message body on the stream)."""
    return _encoder.encode(event)


def decode(raw: bytes | bytearray | memoryview | str) -> Event:
    """A validated event from its JSON, or `EventDecodeError` saying which field and why."""
    if len(raw) > MAX_EVENT_BYTES:
        raise EventDecodeError(
            f"event is {len(raw)} bytes, more than the {MAX_EVENT_BYTES} allowed"
        )
    try:
        return _decoder.decode(raw)
    except msgspec.ValidationError as e:
        raise _translate(str(e), raw) from e
    except RecursionError as e:
        # msgspec reads nested arrays and objects recursively; a body nested thousands
        # deep is no event of the contract, and must not reach the caller as a crash.
        raise EventDecodeError("nested too deeply to be an event") from e
    except msgspec.DecodeError as e:
        if not raw:
            raise EventDecodeError("empty message") from e
        raise EventDecodeError(f"not JSON: {e}") from e


def _translate(msg: str, raw: bytes | bytearray | memoryview | str) -> EventDecodeError:
    m = _AT.match(msg)
    why, path = (m.group("why"), m.group("path")) if m else (msg, None)
    if why.startswith("Expected `object`") and path in (None, "$"):
        return EventDecodeError(f"an event must be a JSON object ({why})", "$")
    if path == "$.type" or (path is None and "type" in msg):
        kind = _peek_type(raw)
        if kind is None:
            return EventDecodeError("missing required field `type`", "$.type")
        if kind not in EVENT_TYPES:
            return EventDecodeError(f"unknown event type {kind!r}", "$.type")
    return EventDecodeError(why, path or "$")


def _peek_type(raw: bytes | bytearray | memoryview | str) -> str | None:
    try:
        doc = _TYPE_PEEK.decode(raw)
    except (msgspec.MsgspecError, RecursionError):
        return None
    if "type" not in doc:
        return None
    kind = doc["type"]
    return kind if isinstance(kind, str) else repr(kind)


def to_builtins(event: Envelope) -> Any:
    """The event as plain JSON-ready Python values."""
    return msgspec.to_builtins(event)
