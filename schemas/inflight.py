"""The gateways' answer to a draining agent: how many requests are in flight on a replica.

Core NATS request and reply on `subjects.gateway_inflight_subject(node, replica)`, never
stored. The agent of a node asks while it drains a replica (`services.agent.gateways`),
every gateway running answers (`services.gateway.server`), and the agent stops the
replica's server once each has folded the drain and has nothing in flight there, or at
the end of the drain's grace. docs/contract.md, "The gateways' in-flight counts".
"""

from __future__ import annotations

import msgspec


class InflightAnswer(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """One gateway's answer. Unknown fields are ignored, as in every event."""

    gateway: str
    """The answering gateway's own id, new at every start."""
    replica: str
    inflight: int = 0
    """Requests of `replica` this gateway is forwarding now."""
    routable: bool = False
    """Whether this gateway would still send it new requests: true until it has folded
    the replica's drain (or its node's loss)."""
    seq: int = 0
    """The stream sequence of the last event its view folded."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(InflightAnswer)


def encode(answer: InflightAnswer) -> bytes:
    return _encoder.encode(answer)


def decode(data: bytes) -> InflightAnswer | None:
    """The answer in `data`; None for anything that is not one (a stranger's reply)."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
