"""The gateways' announcements: who serves, where, how, and how loaded, on core NATS.

Each running gateway publishes one on `subjects.gateway_announce_subject(id)` every
`every` seconds, and one with `leaving` set as it stops cleanly; on a roll call
(`subjects.gateway_rollcall_subject`) it publishes one at once. Never stored: a gateway
silent for `services.core.fleet.EXPIRE_S` is taken for gone. Read by
`services.bus.fleet.Fleet` (the gateways themselves, `llmgw get gateways`, a
draining agent). docs/contract.md, "The gateways' announcements".
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import msgspec
from msgspec import Meta

UtcTime = Annotated[datetime, Meta(tz=True)]


class ModelLoad(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """One model's load through one gateway."""

    requests: int = 0
    """Requests for it since the gateway started."""
    inflight: int = 0
    """Requests for it the gateway is forwarding now."""
    held: int = 0
    """Requests for it the gateway's waiting room holds now."""


class GatewayAnnouncement(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """One gateway's word about itself. Unknown fields are ignored, as in every event, so
    a newer gateway may say more."""

    gateway: str
    """Its own id, new at every start (the id in its answers to draining agents)."""
    address: str = ""
    """Where it serves, `http://HOST:PORT` as it bound it (`0.0.0.0` when it listens on
    every interface: `host` then says which machine)."""
    routing: str = ""
    """Its routing rule (`--routing`)."""
    started: UtcTime
    """When it began serving (its host's clock)."""
    pid: int = 0
    host: str = ""
    """Its host's name."""
    inflight: int = 0
    """Requests it is forwarding now."""
    rate: float = 0.0
    """Requests a second it took over the last `every`."""
    requests: int = 0
    """Requests it took since it started."""
    seq: int = 0
    """The stream sequence its view has folded."""
    models: dict[str, ModelLoad] = {}
    """Per model it has taken requests for: its load (the dashboard's traffic)."""
    every: float = 0.25
    """Seconds between its announcements."""
    leaving: bool = False
    """It is stopping: take it out of the fleet now, not when it falls silent."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(GatewayAnnouncement)


def encode(a: GatewayAnnouncement) -> bytes:
    return _encoder.encode(a)


def decode(data: bytes) -> GatewayAnnouncement | None:
    """The announcement in `data`; None for anything that is not one."""
    try:
        a = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not a.gateway or a.every <= 0 or a.every != a.every:
        return None
    return a
