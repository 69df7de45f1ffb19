"""What the gateways of one plane tell each other: their load, the limits' shares they
hand on, and what they routed where.

Core NATS, never stored (`subjects.share_subject`, `subjects.cache_subject`): chatter
between gateway processes, like the draining agents' questions (`schemas.inflight`). Each
gateway publishes a `Share` every `--share-interval` (its in-flight counts per replica,
its uncached prefill work in flight, its waiting requests per model, the keys it had to
refuse, the tokens of the keys' limits it gives to others) and a `Routed` batch of the
block hashes it routed to each replica; a gateway silent for `--share-expiry` is gone,
and what it said is dropped. docs/contract.md, "The gateways' shared state".
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

# MAX_ENTRIES bounds the maps of one message (replicas, models, keys, gateways): what a
# decoder takes before it refuses the message.
MAX_ENTRIES = 10_000
# MAX_HASHES bounds the block hashes of one replica in one `Routed` batch.
MAX_HASHES = 65_536

Id = Annotated[str, Meta(min_length=1, max_length=253)]
Tag = Annotated[str, Meta(min_length=1, max_length=64)]
Amount = Annotated[float, Meta(ge=0, le=1e12)]


class Share(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """One gateway's state, every `--share-interval`. Unknown fields are ignored."""

    gateway: Id
    """The gateway's own id, new at every start."""
    at: float = 0.0
    """When it was sent, seconds of the Unix epoch on the sender's clock (what the
    receivers measure the delay of shared counts by, on one host)."""
    leaving: bool = False
    """It stops: its share returns to the others now, not when it falls silent."""
    inflight: Annotated[dict[Id, Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_ENTRIES)] = {}
    """Requests it forwards now, per replica (only those with some)."""
    work: Annotated[dict[Id, Amount], Meta(max_length=MAX_ENTRIES)] = {}
    """Uncached prompt tokens of its requests in flight not yet prefilled, per replica
    (the prefix rule's; empty under least-inflight)."""
    waiting: Annotated[dict[Id, Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_ENTRIES)] = {}
    """Requests it holds per model, waiting for a replica (only those with some)."""
    owners: Annotated[
        dict[Id, Annotated[dict[str, Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_ENTRIES)]],
        Meta(max_length=MAX_ENTRIES),
    ] = {}
    """Per model it holds requests of, per owner of their keys ("" for none) how many:
    the waiting room's fair shares, over the fleet's line."""
    want: Annotated[tuple[Tag, ...], Meta(max_length=MAX_ENTRIES)] = ()
    """The keys (their share tags, never the key) it refused a request of since its last
    message: others with room give it some of their share."""
    gives: Annotated[
        dict[Id, Annotated[dict[Tag, tuple[Amount, Amount]], Meta(max_length=MAX_ENTRIES)]],
        Meta(max_length=MAX_ENTRIES),
    ] = {}
    """Per gateway, per key tag: the requests and tokens of the key's limit it hands that
    gateway (taken from its own share as it sends them)."""


class Routed(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The block hashes a gateway routed to each replica since its last batch (the
    prefix rule's index), those it had not told already."""

    gateway: Id
    blocks: Annotated[
        dict[Id, Annotated[tuple[int, ...], Meta(max_length=MAX_HASHES)]],
        Meta(max_length=MAX_ENTRIES),
    ] = {}
    """Per replica, chained hashes of a prompt's blocks, shallowest first (each names the
    prefix up to its block's end; `services.gateway.cache.stable_blocks`)."""


_encoder = msgspec.json.Encoder()
_share = msgspec.json.Decoder(Share)
_routed = msgspec.json.Decoder(Routed)


def encode(message: Share | Routed) -> bytes:
    return _encoder.encode(message)


def decode_share(data: bytes) -> Share | None:
    """The `Share` in `data`; None for anything that is not one."""
    try:
        return _share.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode_routed(data: bytes) -> Routed | None:
    """The `Routed` batch in `data`; None for anything that is not one."""
    try:
        return _routed.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
