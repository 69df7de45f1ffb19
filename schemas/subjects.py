"""NATS subjects of the contract: builders, a parser, and the subject an event belongs on.

Subjects carry the entity (model, node, replica) so NATS permissions can confine an agent
to its own node and consumers can filter cheaply. The root token (default `llmgw`) is a
parameter everywhere. Names are escaped with `schemas.names`, so any model name works.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schemas import events as ev
from schemas.names import TokenError, escape, unescape

DEFAULT_ROOT = "llmgw"
STREAM = "LLMGW"


# _t is cached for the same reason as parse: names repeat, and escaping walks every byte.
_t = functools.lru_cache(maxsize=1 << 16)(escape)


def model_subject(model: str, root: str = DEFAULT_ROOT) -> str:
    return f"{root}.catalog.model.{_t(model)}"


def quota_subject(root: str = DEFAULT_ROOT) -> str:
    return f"{root}.catalog.quota"


def scale_subject(model: str, root: str = DEFAULT_ROOT) -> str:
    return f"{root}.catalog.scale.{_t(model)}"


def demand_subject(model: str, root: str = DEFAULT_ROOT) -> str:
    """Where the gateway says requests for `model` wait (`model.demanded`)."""
    return f"{root}.gateway.demand.{_t(model)}"


def inventory_subject(node: str, root: str = DEFAULT_ROOT) -> str:
    return f"{root}.node.{_t(node)}.inventory"


def replica_subject(node: str, replica: str, root: str = DEFAULT_ROOT) -> str:
    return f"{root}.node.{_t(node)}.replica.{_t(replica)}"


def node_status_subject(node: str, root: str = DEFAULT_ROOT) -> str:
    return f"{root}.node.{_t(node)}.status"


def command_subject(node: str, command: str, root: str = DEFAULT_ROOT) -> str:
    """`command` is `start` or `drain`."""
    return f"{root}.cmd.{_t(node)}.replica.{command}"


def commands_for_node(node: str, root: str = DEFAULT_ROOT) -> str:
    """The wildcard an agent subscribes to for its own commands."""
    return f"{root}.cmd.{_t(node)}.>"


def decision_subject(kind: str, model: str, root: str = DEFAULT_ROOT) -> str:
    """`kind` is one of placement.decided, placement.failed, preemption.decided,
    hold.created, hold.released."""
    return f"{root}.{kind}.{_t(model)}"


def policy_subject(root: str = DEFAULT_ROOT) -> str:
    """Where the preemption service records its settings (`policy.configured`)."""
    return f"{root}.preemption.policy"


def digest_subject(root: str = DEFAULT_ROOT) -> str:
    return f"{root}.view.digest"


def heartbeat_subject(node: str, root: str = DEFAULT_ROOT) -> str:
    """Core NATS, not in the stream."""
    return f"{root}.heartbeat.{_t(node)}"


def agent_subject(node: str, root: str = DEFAULT_ROOT) -> str:
    """Core NATS, request/reply: the live agent of `node` answers who it is (an agent
    starting asks, so that one node never has two)."""
    return f"{root}.heartbeat.{_t(node)}.agent"


def node_of_heartbeat(subject: str) -> str | None:
    """The node a `heartbeat_subject` is of; None for any other subject. A heartbeat
    counts for that node only when its body names the same one."""
    toks = subject.split(".")
    if len(toks) != 3 or toks[1] != "heartbeat":
        return None
    try:
        return unescape(toks[2])
    except TokenError:
        return None


def agent_inbox(node: str) -> str:
    """The inbox prefix of the agent of `node` (`_INBOX_<node>`, no dot after): its
    requests' replies arrive under `_INBOX_<node>.`, which only its own user may
    subscribe to (deploy/nats/agent.conf.in), and the plane answers an agent's request
    nowhere else (`services.bus.replies`)."""
    return f"_INBOX_{_t(node)}"


def gateway_inflight_subject(node: str, replica: str, root: str = DEFAULT_ROOT) -> str:
    """Core NATS, request and reply, not stored: the agent of `node` draining `replica`
    asks every gateway how many of its requests are in flight there, and each answers
    (`services.gateway.server`). The node is in the subject so that an agent may ask
    only about its own replicas. Not under `<root>.gateway.`, which the stream stores."""
    return f"{root}.inflight.{_t(node)}.{_t(replica)}"


def gateway_inflight_wildcard(root: str = DEFAULT_ROOT) -> str:
    """What a gateway subscribes to, to answer every agent's question."""
    return f"{root}.inflight.*.*"


def replica_of_inflight(subject: str) -> str | None:
    """The replica a `gateway_inflight_subject` names; None for any other subject."""
    asked = inflight_asked(subject)
    return None if asked is None else asked[1]


def inflight_asked(subject: str) -> tuple[str, str] | None:
    """(node, replica) of a `gateway_inflight_subject`; None for any other subject."""
    toks = subject.split(".")
    if len(toks) != 4 or toks[1] != "inflight":
        return None
    try:
        return unescape(toks[2]), unescape(toks[3])
    except TokenError:
        return None


def gateway_announce_subject(gateway: str, root: str = DEFAULT_ROOT) -> str:
    """Core NATS, not stored: where the gateway `gateway` announces itself
    (`schemas.fleet.GatewayAnnouncement`) every few hundred milliseconds, and says it
    leaves. Not under `<root>.gateway.`, which the stream stores."""
    return f"{root}.fleet.gateway.{_t(gateway)}"


def gateway_announce_wildcard(root: str = DEFAULT_ROOT) -> str:
    """What a reader of the fleet subscribes to: every gateway's announcements."""
    return f"{root}.fleet.gateway.*"


def gateway_rollcall_subject(root: str = DEFAULT_ROOT) -> str:
    """Core NATS, not stored: a reader that has just begun listening asks here, with an
    empty body, and every gateway announces itself at once on its own subject (no reply
    subject is used: nothing is published where the asker says)."""
    return f"{root}.fleet.rollcall"


def gateway_of_announcement(subject: str) -> str | None:
    """The gateway a `gateway_announce_subject` is of; None for any other subject. An
    announcement counts for that gateway only when its body names the same one."""
    toks = subject.split(".")
    if len(toks) != 4 or toks[1:3] != ["fleet", "gateway"]:
        return None
    try:
        return unescape(toks[3])
    except TokenError:
        return None


def share_subject(gateway: str, root: str = DEFAULT_ROOT) -> str:
    """Core NATS, not stored: where gateway `gateway` says its load, the keys it refused
    and the limits' shares it gives (`schemas.share.Share`), every `--share-interval`.
    Not under `<root>.gateway.`, which the stream stores."""
    return f"{root}.share.load.{_t(gateway)}"


def share_wildcard(root: str = DEFAULT_ROOT) -> str:
    """What a gateway subscribes to, to hear every other's `Share`."""
    return f"{root}.share.load.*"


def cache_subject(gateway: str, root: str = DEFAULT_ROOT) -> str:
    """Core NATS, not stored: the block hashes gateway `gateway` routed to each replica
    (`schemas.share.Routed`), batched."""
    return f"{root}.share.cache.{_t(gateway)}"


def cache_wildcard(root: str = DEFAULT_ROOT) -> str:
    return f"{root}.share.cache.*"


def dlq_subject(consumer: str, root: str = DEFAULT_ROOT) -> str:
    return f"{root}.dlq.{_t(consumer)}"


def stream_subjects(root: str = DEFAULT_ROOT) -> list[str]:
    """What the stream stores: everything under the root except heartbeats and the DLQ,
    which are core NATS chatter and reports, not facts."""
    return [
        f"{root}.catalog.>",
        f"{root}.node.>",
        f"{root}.cmd.>",
        f"{root}.placement.>",
        f"{root}.preemption.>",
        f"{root}.hold.>",
        f"{root}.view.>",
        f"{root}.gateway.>",
    ]


@dataclass(frozen=True, slots=True)
class Parsed:
    """What a subject names. `kind` is the subject's shape, e.g. `node.replica`."""

    kind: str
    model: str | None = None
    node: str | None = None
    replica: str | None = None
    command: str | None = None


class SubjectError(ValueError):
    def __init__(self, subject: str, why: str) -> None:
        super().__init__(f"subject {subject!r}: {why}")
        self.subject = subject
        self.why = why


@functools.lru_cache(maxsize=1 << 16)
def parse(subject: str, root: str = DEFAULT_ROOT) -> Parsed:
    """What a subject of the contract names; `SubjectError` for any other subject.

    Cached: a fold checks every event's subject, and a cluster's subjects repeat (one
    per replica, node and model), so each is parsed once rather than once per event.
    """
    toks = subject.split(".")
    if not toks or toks[0] != root:
        raise SubjectError(subject, f"does not start with {root!r}")
    t = toks[1:]
    try:
        found = _of_model(t) or _of_node(t) or _of_plane(t)
    except TokenError as e:
        raise SubjectError(subject, e.why) from e
    if found is None:
        raise SubjectError(subject, "is not a subject of the contract")
    return found


def _of_model(t: list[str]) -> Parsed | None:
    """A subject about one model (its catalog entry, scale, demand and decisions)."""
    match t:
        case ["catalog", "model", m]:
            return Parsed("catalog.model", model=unescape(m))
        case ["catalog", "scale", m]:
            return Parsed("catalog.scale", model=unescape(m))
        case ["gateway", "demand", m]:
            return Parsed("gateway.demand", model=unescape(m))
        case [("placement" | "preemption" | "hold") as a, b, m]:
            return Parsed(f"{a}.{b}", model=unescape(m))
    return None


def _of_node(t: list[str]) -> Parsed | None:
    """A subject about one node: what its agent reports, and the commands sent to it."""
    match t:
        case ["node", n, "inventory"]:
            return Parsed("node.inventory", node=unescape(n))
        case ["node", n, "status"]:
            return Parsed("node.status", node=unescape(n))
        case ["node", n, "replica", r]:
            return Parsed("node.replica", node=unescape(n), replica=unescape(r))
        case ["cmd", n, "replica", c] if c in ("start", "drain"):
            return Parsed("cmd.replica", node=unescape(n), command=c)
        case ["heartbeat", n]:
            return Parsed("heartbeat", node=unescape(n))
    return None


def _of_plane(t: list[str]) -> Parsed | None:
    """A subject about the whole plane: quota, policy, the view's digest, the DLQ."""
    match t:
        case ["catalog", "quota"]:
            return Parsed("catalog.quota")
        case ["preemption", "policy"]:
            return Parsed("preemption.policy")
        case ["view", "digest"]:
            return Parsed("view.digest")
        case ["dlq", c]:
            return Parsed("dlq", node=None, replica=None, command=unescape(c))
    return None


def subject_for(event: ev.Envelope, root: str = DEFAULT_ROOT, node: str | None = None) -> str:
    """The subject an event is published on.

    Replica events (`replica.state`, `replica.used`) are published by the agent of a node
    and go on that node's subject: pass `node`, else the node of the first shard is used.
    """
    t = type(event)
    d: Any = event.data  # type: ignore[attr-defined]
    # The replica reports first: they are most of a log.
    if t is ev.ReplicaUsedEvent:
        if node is None:
            raise ValueError("a replica.used needs the reporting node")
        return replica_subject(node, d.replica, root)
    if t is ev.ReplicaStateEvent:
        n = node or (d.shards[0].node if d.shards else None)
        if n is None:
            raise ValueError("a replica.state with no shards needs the reporting node")
        return replica_subject(n, d.replica, root)
    named = _BY_NAME.get(t)
    if named is not None:
        build, field = named
        return build(getattr(d, field), root)
    if t is ev.QuotaSetEvent:
        return quota_subject(root)
    if t is ev.ViewDigestEvent:
        return digest_subject(root)
    if t is ev.PolicyConfiguredEvent:
        return policy_subject(root)
    if t is ev.ReplicaStartEvent:
        return command_subject(node or d.shards[0].node, "start", root)
    if t is ev.ReplicaDrainEvent:
        if node is None:
            raise ValueError("a replica.drain needs the node it is sent to")
        return command_subject(node, "drain", root)
    raise ValueError(f"no subject for {t.__name__}")


def _decision(kind: str) -> Callable[[str, str], str]:
    return lambda model, root: decision_subject(kind, model, root)


# _BY_NAME: the events whose subject is a builder of one name in their data. A dict
# dispatch, not a match: subject_for runs for every event a folder checks.
_BY_NAME: dict[type, tuple[Callable[[str, str], str], str]] = {
    ev.ModelDeclaredEvent: (model_subject, "name"),
    ev.ModelRemovedEvent: (model_subject, "name"),
    ev.ScaleDesiredEvent: (scale_subject, "model"),
    ev.ModelDemandedEvent: (demand_subject, "model"),
    ev.NodeInventoryEvent: (inventory_subject, "node"),
    ev.NodeLostEvent: (node_status_subject, "node"),
    ev.NodeFoundEvent: (node_status_subject, "node"),
    ev.NodeCordonedEvent: (node_status_subject, "node"),
    ev.NodeUncordonedEvent: (node_status_subject, "node"),
    ev.NodeRemovedEvent: (node_status_subject, "node"),
    ev.PlacementDecidedEvent: (_decision("placement.decided"), "model"),
    ev.PlacementFailedEvent: (_decision("placement.failed"), "model"),
    ev.PreemptionDecidedEvent: (_decision("preemption.decided"), "for_model"),
    ev.HoldCreatedEvent: (_decision("hold.created"), "model"),
    ev.HoldReleasedEvent: (_decision("hold.released"), "model"),
}

_REPLICA_REPORTS = (ev.ReplicaStateEvent, ev.ReplicaUsedEvent)
_COMMANDS = {ev.ReplicaStartEvent: "start", ev.ReplicaDrainEvent: "drain"}


def check(event: ev.Envelope, subject: str, root: str = DEFAULT_ROOT) -> str | None:
    """Why an event does not belong on the subject it arrived on, or None if it does."""
    try:
        p = parse(subject, root)
    except SubjectError as e:
        return e.why
    t = type(event)
    d: Any = event.data  # type: ignore[attr-defined]
    if t in _REPLICA_REPORTS:
        if p.kind != "node.replica":
            return f"{type(d).__name__} on a {p.kind} subject"
        if p.replica != d.replica:
            return f"subject names replica {p.replica!r} but data says {d.replica!r}"
        return None
    want = _COMMANDS.get(t)
    if want is not None:
        if p.kind != "cmd.replica" or p.command != want:
            return f"replica.{want} command on a {p.kind} subject"
        if want == "start" and p.node not in {s.node for s in d.shards}:
            return f"replica.start sent to node {p.node!r}, which holds none of its shards"
        return None
    expected = subject_for(event, root)
    if expected != subject:
        return f"a {type_tag(event)} event belongs on {expected!r}"
    return None


def type_tag(event: ev.Envelope) -> str:
    return ev.type_of(type(event))
