"""The event contract: every event of DESIGN.md as a frozen msgspec Struct.

Everything that publishes, folds, replays or exports an event uses these types; they are
the interface other teams build against. Evolution rules: a new field gets a default; a
field's type never changes; unknown fields are ignored (so an old replayer skips new
fields); a breaking change is a new type plus an upcaster.

One event is one envelope (`id`, `type`, `time`, `source`, `causation`, `correlation`,
`data`). Each type is its own envelope Struct tagged by `type`, with `data` typed for it,
so a single msgspec decode both dispatches and validates. This module does no I/O.
"""

from __future__ import annotations

import typing
from datetime import datetime
from typing import Annotated, Literal, NewType

import msgspec
from msgspec import Meta

ReplicaId = NewType("ReplicaId", str)
ModelName = NewType("ModelName", str)
NodeName = NewType("NodeName", str)
EventId = NewType("EventId", str)

Name = Annotated[str, Meta(min_length=1, max_length=253)]
Count = Annotated[int, Meta(ge=0)]
Quantity = Annotated[float, Meta(ge=0)]
UtcTime = Annotated[datetime, Meta(tz=True)]

ModelClass = Literal["critical", "standard", "opportunistic"]
ReplicaStateName = Literal[
    "pending", "starting", "loading", "ready", "draining", "stopped", "failed"
]
DrainReason = Literal["preempted", "scale_down", "node_drain", "model_removed", "placement_timeout"]

# STATE_ORDER ranks replica states along their one-way life. A report may repeat a state
# or move forward; one that moves back is an invariant broken, not news.
STATE_ORDER: dict[str, int] = {
    "pending": 0,
    "starting": 1,
    "loading": 2,
    "ready": 3,
    "draining": 4,
    "stopped": 5,
    "failed": 5,
}

# HOLDING_STATES hold GPUs; a replica's capacity is released when it is stopped or failed.
HOLDING_STATES = frozenset({"pending", "starting", "loading", "ready", "draining"})


class Data(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False, gc=False):
    """Base of every event's `data`.

    gc=False: events are leaves (they never refer back to anything that refers to them),
    so the cycle collector has nothing to find in them; a fold of a million events would
    otherwise spend a good part of its time walking them.
    """


# ---------------------------------------------------------------- catalog


class ProfileSpec(Data, frozen=True, kw_only=True):
    name: Name
    gpus: Count
    """GPUs per shard."""
    shards: Annotated[int, Meta(ge=1)] = 1
    gpu_memory_gb: Quantity = 0.0
    gpu_model: str | None = None
    """None: any GPU model."""
    cpu_cores: Quantity = 0.0
    """Per shard."""
    memory_gb: Quantity = 0.0
    """Per shard."""


class ModelDeclared(Data, frozen=True, kw_only=True):
    name: Name
    owner: Name = "default"
    cls: ModelClass = msgspec.field(default="standard", name="class")
    min: Count = 1
    max: Count | None = None
    """None: max(min, 1)."""
    aliases: tuple[Name, ...] = ()
    profiles: tuple[ProfileSpec, ...] = ()

    @property
    def effective_max(self) -> int:
        return self.max if self.max is not None else max(self.min, 1)


class ModelRemoved(Data, frozen=True, kw_only=True):
    name: Name


class Resources(Data, frozen=True, kw_only=True):
    gpus: Count = 0
    cpu_cores: Quantity = 0.0
    memory_gb: Quantity = 0.0


class OwnerQuota(Data, frozen=True, kw_only=True):
    name: Name
    parent: Name | None = None
    """None: a root of the tree."""
    guarantee: Resources = Resources()
    limit: Resources | None = None
    """None: no limit."""


class QuotaSet(Data, frozen=True, kw_only=True):
    owners: tuple[OwnerQuota, ...] = ()


class ScaleDesired(Data, frozen=True, kw_only=True):
    model: Name
    replicas: Count


# ---------------------------------------------------------------- nodes


class GpuInfo(Data, frozen=True, kw_only=True):
    index: Count
    uuid: str
    model: str
    memory_gb: Quantity
    healthy: bool = True


class NodeInventory(Data, frozen=True, kw_only=True):
    node: Name
    gpus: tuple[GpuInfo, ...]
    cpu_cores: Quantity
    memory_gb: Quantity
    labels: dict[str, str] = msgspec.field(default_factory=dict)


class NodeLost(Data, frozen=True, kw_only=True):
    node: Name
    reason: str


class NodeCordoned(Data, frozen=True, kw_only=True):
    node: Name


class NodeUncordoned(Data, frozen=True, kw_only=True):
    node: Name


# ---------------------------------------------------------------- replicas


class ShardSpec(Data, frozen=True, kw_only=True):
    node: Name
    gpus: tuple[Count, ...]


class ReplicaState(Data, frozen=True, kw_only=True):
    replica: Name
    model: Name
    profile: Name
    state: ReplicaStateName
    shards: tuple[ShardSpec, ...] = ()
    reason: str | None = None


class ReplicaUsed(Data, frozen=True, kw_only=True):
    replica: Name
    at: UtcTime
    """When the replica last served a request."""


# ---------------------------------------------------------------- decisions and commands


class PlacementDecided(Data, frozen=True, kw_only=True):
    replica: Name
    model: Name
    profile: Name
    shards: tuple[ShardSpec, ...]
    reason: str


class PlacementFailed(Data, frozen=True, kw_only=True):
    model: Name
    profiles: tuple[str, ...]
    """Names of the profiles tried."""
    avoid: tuple[str, ...] = ()
    live: Count
    desired: Count
    reason: str
    """no_fit, quota_limit, ..."""
    why: dict[str, str] = msgspec.field(default_factory=dict)
    """Per profile tried, why it did not fit (an extension of the contract)."""


class ReplicaStart(Data, frozen=True, kw_only=True):
    replica: Name
    model: Name
    profile: Name
    shards: tuple[ShardSpec, ...]


class ReplicaDrain(Data, frozen=True, kw_only=True):
    replica: Name
    model: Name
    reason: DrainReason
    for_model: str | None = None
    grace_s: Quantity = 30.0


class Victim(Data, frozen=True, kw_only=True):
    replica: Name
    model: Name
    cls: str = msgspec.field(name="class")
    tier: int
    above_min: bool
    idle_s: float | None = None
    """None: nobody ever reported the replica used, which is not the same as idle."""
    gpus: Count


class Excluded(Data, frozen=True, kw_only=True):
    replica: Name
    model: str = ""
    why: str


class Trial(Data, frozen=True, kw_only=True):
    victims: tuple[str, ...]
    fits: bool


class HoldSpec(Data, frozen=True, kw_only=True):
    model: Name
    for_model: Name
    until: UtcTime


class PreemptionDecided(Data, frozen=True, kw_only=True):
    for_model: Name
    outcome: str
    """fits, preempted, no_fit, no_candidates, awaiting, quota_limit, ..."""
    victims: tuple[Victim, ...] = ()
    considered: Count = 0
    """How many candidates the policy weighed."""
    trigger: str = ""
    """Id of the placement.failed this decision answers."""
    candidates: tuple[Victim, ...] = ()
    """Every candidate in the order the policy tried them (extension)."""
    excluded: tuple[Excluded, ...] = ()
    trials: tuple[Trial, ...] = ()
    holds: tuple[HoldSpec, ...] = ()


class HoldCreated(Data, frozen=True, kw_only=True):
    model: Name
    for_model: Name
    until: UtcTime


class HoldReleased(Data, frozen=True, kw_only=True):
    model: Name
    reason: str
    """expired, satisfied."""


class ViewDigest(Data, frozen=True, kw_only=True):
    seq: Count
    digest: str


# ---------------------------------------------------------------- envelopes


class Envelope(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", gc=False):
    """What every event carries around its data."""

    id: Annotated[str, Meta(min_length=1, max_length=128)]
    time: UtcTime
    source: str
    causation: str | None = None
    """Id of the event this one reacts to."""
    correlation: str | None = None
    """Id of the first event of the chain."""


class ModelDeclaredEvent(Envelope, frozen=True, kw_only=True, tag="model.declared"):
    data: ModelDeclared


class ModelRemovedEvent(Envelope, frozen=True, kw_only=True, tag="model.removed"):
    data: ModelRemoved


class QuotaSetEvent(Envelope, frozen=True, kw_only=True, tag="quota.set"):
    data: QuotaSet


class ScaleDesiredEvent(Envelope, frozen=True, kw_only=True, tag="scale.desired"):
    data: ScaleDesired


class NodeInventoryEvent(Envelope, frozen=True, kw_only=True, tag="node.inventory"):
    data: NodeInventory


class NodeLostEvent(Envelope, frozen=True, kw_only=True, tag="node.lost"):
    data: NodeLost


class NodeCordonedEvent(Envelope, frozen=True, kw_only=True, tag="node.cordoned"):
    data: NodeCordoned


class NodeUncordonedEvent(Envelope, frozen=True, kw_only=True, tag="node.uncordoned"):
    data: NodeUncordoned


class ReplicaStateEvent(Envelope, frozen=True, kw_only=True, tag="replica.state"):
    data: ReplicaState


class ReplicaUsedEvent(Envelope, frozen=True, kw_only=True, tag="replica.used"):
    data: ReplicaUsed


class PlacementDecidedEvent(Envelope, frozen=True, kw_only=True, tag="placement.decided"):
    data: PlacementDecided


class PlacementFailedEvent(Envelope, frozen=True, kw_only=True, tag="placement.failed"):
    data: PlacementFailed


class ReplicaStartEvent(Envelope, frozen=True, kw_only=True, tag="replica.start"):
    data: ReplicaStart


class ReplicaDrainEvent(Envelope, frozen=True, kw_only=True, tag="replica.drain"):
    data: ReplicaDrain


class PreemptionDecidedEvent(Envelope, frozen=True, kw_only=True, tag="preemption.decided"):
    data: PreemptionDecided


class HoldCreatedEvent(Envelope, frozen=True, kw_only=True, tag="hold.created"):
    data: HoldCreated


class HoldReleasedEvent(Envelope, frozen=True, kw_only=True, tag="hold.released"):
    data: HoldReleased


class ViewDigestEvent(Envelope, frozen=True, kw_only=True, tag="view.digest"):
    data: ViewDigest


Event = (
    ModelDeclaredEvent
    | ModelRemovedEvent
    | QuotaSetEvent
    | ScaleDesiredEvent
    | NodeInventoryEvent
    | NodeLostEvent
    | NodeCordonedEvent
    | NodeUncordonedEvent
    | ReplicaStateEvent
    | ReplicaUsedEvent
    | PlacementDecidedEvent
    | PlacementFailedEvent
    | ReplicaStartEvent
    | ReplicaDrainEvent
    | PreemptionDecidedEvent
    | HoldCreatedEvent
    | HoldReleasedEvent
    | ViewDigestEvent
)

EVENT_CLASSES: tuple[type[Envelope], ...] = (
    ModelDeclaredEvent,
    ModelRemovedEvent,
    QuotaSetEvent,
    ScaleDesiredEvent,
    NodeInventoryEvent,
    NodeLostEvent,
    NodeCordonedEvent,
    NodeUncordonedEvent,
    ReplicaStateEvent,
    ReplicaUsedEvent,
    PlacementDecidedEvent,
    PlacementFailedEvent,
    ReplicaStartEvent,
    ReplicaDrainEvent,
    PreemptionDecidedEvent,
    HoldCreatedEvent,
    HoldReleasedEvent,
    ViewDigestEvent,
)


def type_of(cls: type[Envelope]) -> str:
    """The `type` tag of an envelope class."""
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


# EVENT_TYPES maps each `type` tag to its envelope class, and DATA_TYPES to its data class.
EVENT_TYPES: dict[str, type[Envelope]] = {type_of(c): c for c in EVENT_CLASSES}
DATA_TYPES: dict[str, type[Data]] = {
    t: typing.get_type_hints(c)["data"] for t, c in EVENT_TYPES.items()
}
_ENVELOPE_FOR_DATA: dict[type[Data], type[Envelope]] = {
    DATA_TYPES[t]: c for t, c in EVENT_TYPES.items()
}


def make(
    data: Data,
    *,
    id: str,
    time: datetime,
    source: str,
    causation: str | None = None,
    correlation: str | None = None,
) -> Event:
    """Wrap data in the envelope of its type."""
    cls = _ENVELOPE_FOR_DATA[type(data)]
    ev: Event = cls(  # type: ignore[assignment,call-arg]
        id=id, time=time, source=source, causation=causation, correlation=correlation, data=data
    )
    return ev
