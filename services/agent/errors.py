"""Errors of the agent: one base class, data kept as fields.

Raised by `services.agent` (spec parsing, start-up checks) and read by `services.cli.agent`
and `llmgw up`, which show them as one line. This module does no I/O.
"""

from __future__ import annotations

from services.bus.urls import public_url


class AgentError(Exception):
    """Base of every error `services.agent` raises."""


class SpecError(AgentError, ValueError):
    """A GPU or cluster spec that does not parse: `text` as given, `why` it is wrong, and
    `example` of one that does. The message is the one line a user sees."""

    def __init__(self, kind: str, text: str, why: str, example: str) -> None:
        self.kind = kind
        self.text = text
        self.why = why
        self.example = example
        super().__init__(f"bad {kind} spec {text!r}: {why} (for example {example})")


class NoStream(AgentError):
    """The broker has no event stream yet: the control plane has not been set up there.
    `url` is where, as connected (its credentials too); the message shows it without them."""

    def __init__(self, stream: str, url: str | None = None) -> None:
        self.stream = stream
        self.url = url
        where = f" at {public_url(url)}" if url else ""
        super().__init__(
            f"the broker{where} has no stream {stream}: start the control plane with "
            "`llmgw up` (or point --nats at one that runs it) before the agent"
        )


class NodeTaken(AgentError):
    """Another agent of the same node is alive (it answered): two agents of one node
    would each report its inventory and replicas over the other's."""

    def __init__(self, node: str, other: str) -> None:
        self.node = node
        self.other = other
        super().__init__(
            f"node {node} already has a live agent ({other}): stop it first, or start "
            "this one with --takeover to replace it"
        )
