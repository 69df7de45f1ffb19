"""The contract of llmgw: events, subjects, ids, codec and bundles.

Imports nothing of ours and does no I/O beyond the bundle reader's file. Everything that
others build against lives here; see DESIGN.md's event contract.
"""

from schemas import bundle, codec, events, ids, names, subjects
from schemas.codec import decode, encode
from schemas.errors import BundleError, EventDecodeError, SchemaError
from schemas.events import EVENT_TYPES, Envelope, Event, make

__all__ = [
    "EVENT_TYPES",
    "BundleError",
    "Envelope",
    "Event",
    "EventDecodeError",
    "SchemaError",
    "bundle",
    "codec",
    "decode",
    "encode",
    "events",
    "ids",
    "make",
    "names",
    "subjects",
]
