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

# The bounded contract. Every number and string a producer sends has a range, checked by
# the one decode, so nothing out of range reaches the fold, SQLite or an operator's screen:
# an event outside it is a decode error and goes to the dead letters. The ranges are far
# past any real cluster and far inside what SQLite's 64-bit integers and a JSON reader's
# 53-bit exact integers hold. docs/contract.md lists them; change both together.

# MAX_REPLICAS bounds replica counts (a model's min, max and desired, live counts). A
# model with more than this many replicas is a typo or an attack, not a plan.
MAX_REPLICAS = 100_000
# MAX_GPUS bounds GPU counts (a profile's shard, a quota, a victim's GPUs): a hundred
# thousand 8-GPU hosts' worth.
MAX_GPUS = 1_000_000
# MAX_GPU_INDEX bounds a GPU's index on its host; no host has a thousand GPUs.
MAX_GPU_INDEX = 1023
# MAX_QUANTITY bounds cores, GiB and seconds given as floats: finite, and no node has a
# billion of anything.
MAX_QUANTITY = 1e9
# MAX_SEQ bounds a stream sequence named inside an event (2^53: exact in every JSON reader).
MAX_SEQ = 2**53
# MAX_TEXT bounds free text (reasons, sources, GPU models): a line, not a document.
MAX_TEXT = 4096
# MAX_ITEMS bounds the lists of an event (GPUs of a node, shards, profiles, owners,
# candidates). The event's size is bounded too (codec.MAX_EVENT_BYTES).
MAX_ITEMS = 10_000

Name = Annotated[str, Meta(min_length=1, max_length=253)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Count = Annotated[int, Meta(ge=0, le=MAX_REPLICAS)]
GpuCount = Annotated[int, Meta(ge=0, le=MAX_GPUS)]
GpuIndex = Annotated[int, Meta(ge=0, le=MAX_GPU_INDEX)]
BigCount = Annotated[int, Meta(ge=0, le=MAX_SEQ)]
Seq = Annotated[int, Meta(ge=0, le=MAX_SEQ)]
Quantity = Annotated[float, Meta(ge=0, le=MAX_QUANTITY)]
Seconds = Annotated[float, Meta(ge=-MAX_QUANTITY, le=MAX_QUANTITY)]
UtcTime = Annotated[datetime, Meta(tz=True)]

ModelClass = Literal["critical", "standard", "opportunistic"]
ReplicaStateName = Literal[
    "pending", "starting", "loading", "ready", "draining", "stopped", "failed"
]
# DrainReason `shard_failed` (an extension): another shard of the replica failed (its node
# lost past the grace, its GPUs gone, its server failed), so this one cannot serve.
DrainReason = Literal[
    "preempted", "scale_down", "node_drain", "model_removed", "placement_timeout", "shard_failed"
]

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


TopologyMode = Literal["required", "preferred"]


class TopologySpec(Data, frozen=True, kw_only=True):
    """Where a profile's shards go in the cluster's topology (an extension of the contract).

    `level` is a level of the cluster file's `topology:` list and the key of a node's label
    naming its domain at that level (`nvlink_domain: nvl-3`). `required`: every shard in one
    domain of that level; `preferred`: as few domains as can hold them."""

    level: Name
    mode: TopologyMode = "required"


class ProfileSpec(Data, frozen=True, kw_only=True):
    name: Name
    gpus: GpuCount
    """GPUs per shard."""
    shards: Annotated[int, Meta(ge=1, le=MAX_GPU_INDEX + 1)] = 1
    gpu_memory_gb: Quantity = 0.0
    gpu_model: Text | None = None
    """None: any GPU model."""
    cpu_cores: Quantity = 0.0
    """Per shard."""
    memory_gb: Quantity = 0.0
    """Per shard."""
    topology: TopologySpec | None = None
    """None: shards on any distinct nodes (every profile before this field)."""


Engine = Literal["vllm", "sglang", "command"]

# DEFAULT_TARGET_INFLIGHT is a model's `target_inflight` when it declares none: the
# requests one replica is meant to serve at once. A continuous-batching server keeps its
# throughput well past a handful; far more and the time to first token grows for all.
DEFAULT_TARGET_INFLIGHT = 8
# DEFAULT_IDLE_AFTER_S is a model's `idle_after_s` when it declares none: 15 minutes with
# no request before an on-demand model goes back to zero. Shorter and a model whose users
# pause for a coffee pays a cold start of minutes; longer and its GPUs sit idle.
DEFAULT_IDLE_AFTER_S = 900.0


class ModelRuntime(Data, frozen=True, kw_only=True):
    """How an agent on a GPU host runs a replica's model server (an extension of the
    contract: a model without one runs only on simulated nodes)."""

    engine: Engine
    command: Annotated[tuple[Text, ...], Meta(max_length=MAX_ITEMS)] = ()
    """For `command`: the server's argv, with {port} {host} {model} {replica} {gpus} {tp}."""
    args: Annotated[tuple[Text, ...], Meta(max_length=MAX_ITEMS)] = ()
    """Extra arguments after the engine's own command line (same placeholders)."""
    env: Annotated[dict[Text, Text], Meta(max_length=MAX_ITEMS)] = msgspec.field(
        default_factory=dict
    )
    health: Text = "/health"
    """The HTTP path polled for readiness: ready once it answers 200."""
    ready_timeout: Quantity = 900.0
    """Seconds from start to ready before the replica is failed."""
    metrics: Text | None = None
    """The Prometheus path scraped for use. None: `/metrics` for vllm and sglang, no
    scraping for `command`; "" turns scraping off."""
    python: Text | None = None
    """Extension: the interpreter of the engine's environment (a path, or a name looked
    up on the server's PATH), for vllm and sglang. Given, vllm runs as `PYTHON -m
    vllm.entrypoints.openai.api_server --model WEIGHTS` (vLLM's server module: what an
    environment kept apart from the agent's, or vLLM's CPU build, runs), sglang as
    `PYTHON -m sglang.launch_server`. None: `vllm serve` and `python3` on the PATH."""
    weights: Text | None = None
    """Extension: what the engine loads (a directory on the host, or a hub name), served
    under the model's name (`--served-model-name MODEL`), which the gateway's requests
    name. None: the model's name is what is loaded."""

    @property
    def metrics_path(self) -> str | None:
        if self.metrics is not None:
            return self.metrics or None
        return None if self.engine == "command" else "/metrics"


class ModelDeclared(Data, frozen=True, kw_only=True):
    name: Name
    owner: Name = "default"
    cls: ModelClass = msgspec.field(default="standard", name="class")
    min: Count = 1
    max: Count | None = None
    """None: max(min, 1)."""
    aliases: Annotated[tuple[Name, ...], Meta(max_length=MAX_ITEMS)] = ()
    profiles: Annotated[tuple[ProfileSpec, ...], Meta(max_length=MAX_ITEMS)] = ()
    runtime: ModelRuntime | None = None
    """None: no server to run (simulated nodes only). An extension of the contract."""
    target_inflight: Annotated[int, Meta(ge=1, le=MAX_REPLICAS)] | None = None
    """Extension: the requests one replica is meant to serve at once, what the autoscaler
    sizes an on-demand model by and the gateway admits per replica. None: the default,
    `DEFAULT_TARGET_INFLIGHT`."""
    idle_after_s: Quantity = DEFAULT_IDLE_AFTER_S
    """Extension: seconds with no request after which the autoscaler takes an on-demand
    model (min 0) back to zero replicas."""
    shared: bool | None = None
    """Extension: whether the gateway's API keys of every owner may use it (true), or
    only those of its owner and the owners below it in the quota tree (false). None:
    shared when its owner is "default" (declared without one), private otherwise."""

    @property
    def effective_max(self) -> int:
        return self.max if self.max is not None else max(self.min, 1)

    @property
    def effective_target_inflight(self) -> int:
        t = self.target_inflight
        return DEFAULT_TARGET_INFLIGHT if t is None else t


class ModelRemoved(Data, frozen=True, kw_only=True):
    name: Name


class Resources(Data, frozen=True, kw_only=True):
    gpus: GpuCount = 0
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
    owners: Annotated[tuple[OwnerQuota, ...], Meta(max_length=MAX_ITEMS)] = ()


class ScaleDesired(Data, frozen=True, kw_only=True):
    model: Name
    replicas: Count
    reason: Text | None = None
    """Extension: why, in words (`demand: 3 waiting since 12:00:01`, `idle 15m`), said by
    the autoscaler; None from an operator, who says how many by hand."""


class ModelDemanded(Data, frozen=True, kw_only=True):
    """Requests for a declared model are waiting in the gateway for a replica that can
    serve them (none routable: at zero, starting, or all full). Published by the gateway
    at once for the first held request and at most once a second per model while
    requests wait; a fact of the log, folded as the model's last demand."""

    model: Name
    waiting: Count
    """Requests held now."""
    since: UtcTime
    """When the longest-held of them arrived."""
    inflight: Count = 0
    """Extension: requests in flight on the model's replicas as the gateway counts them
    (0 when none can serve), so the autoscaler can size past one replica."""


# ---------------------------------------------------------------- nodes


class GpuInfo(Data, frozen=True, kw_only=True):
    index: GpuIndex
    uuid: Text
    model: Text
    memory_gb: Quantity
    healthy: bool = True


# A Host is a node's address as other hosts reach it: a name, or an IPv4 or IPv6 address
# (unbracketed); "" when not said.
Host = Annotated[
    str, Meta(max_length=253, pattern=r"^([A-Za-z0-9._-]+|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)?$")
]


class NodeInventory(Data, frozen=True, kw_only=True):
    node: Name
    gpus: Annotated[tuple[GpuInfo, ...], Meta(max_length=MAX_GPU_INDEX + 1)]
    cpu_cores: Quantity
    memory_gb: Quantity
    labels: Annotated[dict[Text, Text], Meta(max_length=MAX_ITEMS)] = msgspec.field(
        default_factory=dict
    )
    address: Host = ""
    """Extension: the address other hosts reach the node's model servers at (`llmgw
    agent --advertise`). Every endpoint its agent reports is on it, or is rejected. ""
    (every report before this field): not said, and endpoints are not checked."""


class NodeLost(Data, frozen=True, kw_only=True):
    node: Name
    reason: Text
    grace_s: Quantity = 0.0
    """How long the node's replicas keep their state and their GPUs after this: its
    agent may still be serving them. 0 (every `node.lost` from before this field) fails
    them at once; the scheduler's second `node.lost`, once the grace has passed and the
    node has not come back, is a 0."""


class NodeFound(Data, frozen=True, kw_only=True):
    """A lost node heard from again (its agent's heartbeat): it takes placements again,
    and its replicas, not failed yet, keep their state."""

    node: Name
    reason: Text = ""


class NodeCordoned(Data, frozen=True, kw_only=True):
    node: Name


class NodeUncordoned(Data, frozen=True, kw_only=True):
    node: Name


class NodeRemoved(Data, frozen=True, kw_only=True):
    """A node the operator took out of the cluster (`llmgw delete node`): gone from the
    view, its GPUs out of every total, its lost alert over. A replica still holding GPUs
    there fails with it. Its agent reporting again (`node.inventory`) adds it back, as
    a node never seen before."""

    node: Name
    reason: Text = ""


# ---------------------------------------------------------------- replicas


class ShardSpec(Data, frozen=True, kw_only=True):
    node: Name
    gpus: Annotated[tuple[GpuIndex, ...], Meta(max_length=MAX_GPU_INDEX + 1)]


# An Endpoint is where a replica's server answers requests, as other hosts reach it:
# `http://host:port` (a name, an IPv4 address or a bracketed IPv6 one), no path, no
# credentials. The gateway joins its request paths to it; anything else in the field
# (a path, a query, a user:password@) would be joined or printed where it must not be.
Endpoint = Annotated[
    str,
    Meta(
        max_length=300,
        pattern=r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):[0-9]{1,5}$",
    ),
]


class ReplicaState(Data, frozen=True, kw_only=True):
    replica: Name
    model: Name
    profile: Name
    state: ReplicaStateName
    shards: Annotated[tuple[ShardSpec, ...], Meta(max_length=MAX_GPU_INDEX + 1)] = ()
    reason: Text | None = None
    endpoint: Endpoint | None = None
    """Where its server answers (`http://host:port`), said when it is ready; an extension."""
    node: Name | None = None
    """The node whose shard the report is about, said by the agent of one shard of a
    multi-node replica; None: the report is about the whole replica (every report before
    this field). A `stopped` naming a node frees that shard only; an extension."""


class OwnerUse(Data, frozen=True, kw_only=True):
    """One owner's share of a replica's use over the interval a `replica.used` reports."""

    requests: BigCount = 0
    tokens_in: BigCount = 0
    tokens_out: BigCount = 0


class EngineLoad(Data, frozen=True, kw_only=True):
    """What a replica's engine said of itself in its metrics when its agent last read
    them (vLLM's names in brackets). Counters count from the server's start. None: the
    engine does not expose it."""

    at: UtcTime
    """When the agent read them."""
    running: BigCount | None = None
    """Requests being computed (`vllm:num_requests_running`)."""
    waiting: BigCount | None = None
    """Requests queued for a place in the batch (`vllm:num_requests_waiting`)."""
    kv_cache_usage: Annotated[float, Meta(ge=0, le=1)] | None = None
    """The fraction of the KV cache in use, 0 to 1 (`vllm:kv_cache_usage_perc`)."""
    prefix_cache_queries: BigCount | None = None
    """Prompt tokens looked up in the prefix cache (`vllm:prefix_cache_queries`)."""
    prefix_cache_hits: BigCount | None = None
    """Of those, the tokens found there (`vllm:prefix_cache_hits`)."""
    prompt_tokens: BigCount | None = None
    """Prompt tokens processed (`vllm:prompt_tokens`)."""
    generation_tokens: BigCount | None = None
    """Tokens generated (`vllm:generation_tokens`)."""


class ReplicaUsed(Data, frozen=True, kw_only=True):
    replica: Name
    at: UtcTime
    """When the replica last served a request."""
    requests: BigCount | None = None
    """Extension, from the gateway: requests it served over the interval it reports;
    None from an agent, which sees only that the server was used."""
    tokens_in: BigCount | None = None
    """Extension: prompt tokens of those requests, as their answers' `usage` said."""
    tokens_out: BigCount | None = None
    """Extension: completion tokens of those requests, as their answers' `usage` said."""
    tokens_cached: BigCount | None = None
    """Extension: of `tokens_in`, those the engine served from its prefix cache, as the
    answers' `usage.prompt_tokens_details.cached_tokens` said (vLLM with
    `--enable-prompt-tokens-details`). None: no answer said."""
    engine: EngineLoad | None = None
    """Extension, from an agent: what the replica's engine said of its load in its
    metrics. None: not read (a simulated node, an engine without metrics)."""
    by_owner: Annotated[dict[Name, OwnerUse], Meta(max_length=MAX_ITEMS)] = msgspec.field(
        default_factory=dict
    )
    """Extension, from a gateway with API keys: those requests and tokens per owner of
    the key that sent them (requests sent without a key are in no owner's); empty from
    an agent, or a gateway without keys."""
    moved_to: Annotated[dict[Name, BigCount], Meta(max_length=MAX_ITEMS)] = msgspec.field(
        default_factory=dict
    )
    """Extension, from a gateway: the streams in flight on the replica that moved to
    another replica over the interval (its stream broke, or its drain was folded), per
    replica they went to; empty when none moved."""


# ---------------------------------------------------------------- decisions and commands


class PlacementDecided(Data, frozen=True, kw_only=True):
    replica: Name
    model: Name
    profile: Name
    shards: Annotated[tuple[ShardSpec, ...], Meta(max_length=MAX_GPU_INDEX + 1)]
    reason: Text


class PlacementFailed(Data, frozen=True, kw_only=True):
    model: Name
    profiles: Annotated[tuple[Text, ...], Meta(max_length=MAX_ITEMS)]
    """Names of the profiles tried."""
    avoid: Annotated[tuple[Text, ...], Meta(max_length=MAX_ITEMS)] = ()
    live: Count
    desired: Count
    reason: Text
    """no_fit, quota_limit, ..."""
    why: Annotated[dict[Text, Text], Meta(max_length=MAX_ITEMS)] = msgspec.field(
        default_factory=dict
    )
    """Per profile tried, why it did not fit (an extension of the contract)."""


class ReplicaStart(Data, frozen=True, kw_only=True):
    replica: Name
    model: Name
    profile: Name
    shards: Annotated[tuple[ShardSpec, ...], Meta(max_length=MAX_GPU_INDEX + 1)]


# DRAIN_GRACE_S is the grace a `replica.drain` gives its replica to finish its requests
# when it names none: the contract's default, and the one default of the scheduler's and
# the preemption service's drains, `llmgw drain node` and the agent. Shorter cuts
# requests off mid-answer; longer keeps the room from the model waiting for it.
DRAIN_GRACE_S = 30.0


class ReplicaDrain(Data, frozen=True, kw_only=True):
    replica: Name
    model: Name
    reason: DrainReason
    for_model: Text | None = None
    grace_s: Quantity = DRAIN_GRACE_S


class Victim(Data, frozen=True, kw_only=True):
    replica: Name
    model: Name
    cls: Text = msgspec.field(name="class")
    tier: Annotated[int, Meta(ge=0, le=99)]
    above_min: bool
    idle_s: Seconds | None = None
    """None: nobody ever reported the replica used, which is not the same as idle.
    Negative when the use was stamped after the decision's now (clock skew)."""
    gpus: GpuCount


class Excluded(Data, frozen=True, kw_only=True):
    replica: Name
    model: Text = ""
    why: Text


class Trial(Data, frozen=True, kw_only=True):
    victims: Annotated[tuple[Text, ...], Meta(max_length=MAX_ITEMS)]
    fits: bool


class HoldSpec(Data, frozen=True, kw_only=True):
    model: Name
    for_model: Name
    until: UtcTime


class PreemptionDecided(Data, frozen=True, kw_only=True):
    for_model: Name
    outcome: Text
    """fits, preempted, no_fit, no_candidates, awaiting, quota_limit, ..."""
    victims: Annotated[tuple[Victim, ...], Meta(max_length=MAX_ITEMS)] = ()
    considered: BigCount = 0
    """How many candidates the policy weighed."""
    trigger: Text = ""
    """Id of the placement.failed this decision answers."""
    candidates: Annotated[tuple[Victim, ...], Meta(max_length=MAX_ITEMS)] = ()
    """The candidates in the order the policy weighs them (extension): the first 50, then
    any victim past them (node-aware's can be anywhere in the order); `considered` is
    how many there were."""
    excluded: Annotated[tuple[Excluded, ...], Meta(max_length=MAX_ITEMS)] = ()
    """The exclusions by replica id (extension): the first 50; `excluded_count` is how
    many there were."""
    trials: Annotated[tuple[Trial, ...], Meta(max_length=MAX_ITEMS)] = ()
    holds: Annotated[tuple[HoldSpec, ...], Meta(max_length=MAX_ITEMS)] = ()
    policy: Text = "reference"
    """The policy that decided (reference, node-aware); a decision from before the
    field was added was the reference's."""
    by_tier: Annotated[dict[Text, BigCount], Meta(max_length=MAX_ITEMS)] = msgspec.field(
        default_factory=dict
    )
    """Extension: how many candidates there were of each tier ("0" to "4"), listed or
    not; empty from a decision made before the field was added."""
    excluded_count: BigCount = 0
    """Extension: how many replicas holding capacity were excluded, listed or not."""
    excluded_by: Annotated[dict[Text, BigCount], Meta(max_length=MAX_ITEMS)] = msgspec.field(
        default_factory=dict
    )
    """Extension: how many were excluded for each reason (the codes of `excluded`)."""
    reason: Text = ""
    """Why, in words (extension). A `fits` answers a placement that failed although the
    room is there (the scheduler held the model back, a node backing off after failed
    starts): it says that nothing was stopped and what still keeps the model unplaced.
    Empty in a decision from before the field was added."""
    spans: Annotated[dict[Text, tuple[Name, ...]], Meta(max_length=MAX_ITEMS)] = msgspec.field(
        default_factory=dict
    )
    """Extension: the victims whose shards are on several nodes (gangs), each with its
    nodes: every one of them is drained. {} for a decision with none."""
    domain: Text = ""
    """Extension: where the model goes once the victims stop, `level=value` of the
    topology level its profile keeps it in; "" when it keeps it in none."""
    engine: Text = ""
    """Extension: the policy engine that decided (plain, fast, checked), each deciding
    the same; "" in a decision from before the field was added."""


class HoldCreated(Data, frozen=True, kw_only=True):
    model: Name
    for_model: Name
    until: UtcTime


class HoldReleased(Data, frozen=True, kw_only=True):
    model: Name
    reason: Text
    """expired, satisfied."""


class PolicyConfigured(Data, frozen=True, kw_only=True):
    """The settings a preemption service decides with, recorded when a leader starts with
    settings the log does not show yet, so replay and `llmgw preemption plan` use what was
    live. The fields are the policy's (`services.core.policy.Config`) and the service's
    drain grace; a setting added later gets a default here, and a reader of an older event
    takes that default."""

    hold_s: Quantity
    eviction_grace_s: Quantity
    min_lifetime_s: Quantity
    max_victims: Annotated[int, Meta(ge=1, le=MAX_ITEMS)]
    drain_grace_s: Quantity
    holder: Text = ""
    """The process that recorded it (the lease holder's name)."""
    policy: Text = "reference"
    """The search for victims (reference, node-aware); older records were reference."""
    engine: Text = ""
    """Extension: how the service worked the policy's answers out (plain, fast,
    checked: `--policy-engine`), each deciding the same; "" in a record from before the
    field was added (its service ran the index unless switched off)."""


class ViewDigest(Data, frozen=True, kw_only=True):
    seq: Seq
    digest: Text


# ---------------------------------------------------------------- envelopes


class Envelope(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", gc=False):
    """What every event carries around its data."""

    id: Annotated[str, Meta(min_length=1, max_length=128)]
    time: UtcTime
    source: Text
    causation: Text | None = None
    """Id of the event this one reacts to."""
    correlation: Text | None = None
    """Id of the first event of the chain."""


class ModelDeclaredEvent(Envelope, frozen=True, kw_only=True, tag="model.declared"):
    data: ModelDeclared


class ModelRemovedEvent(Envelope, frozen=True, kw_only=True, tag="model.removed"):
    data: ModelRemoved


class QuotaSetEvent(Envelope, frozen=True, kw_only=True, tag="quota.set"):
    data: QuotaSet


class ScaleDesiredEvent(Envelope, frozen=True, kw_only=True, tag="scale.desired"):
    data: ScaleDesired


class ModelDemandedEvent(Envelope, frozen=True, kw_only=True, tag="model.demanded"):
    data: ModelDemanded


class NodeInventoryEvent(Envelope, frozen=True, kw_only=True, tag="node.inventory"):
    data: NodeInventory


class NodeLostEvent(Envelope, frozen=True, kw_only=True, tag="node.lost"):
    data: NodeLost


class NodeFoundEvent(Envelope, frozen=True, kw_only=True, tag="node.found"):
    data: NodeFound


class NodeCordonedEvent(Envelope, frozen=True, kw_only=True, tag="node.cordoned"):
    data: NodeCordoned


class NodeUncordonedEvent(Envelope, frozen=True, kw_only=True, tag="node.uncordoned"):
    data: NodeUncordoned


class NodeRemovedEvent(Envelope, frozen=True, kw_only=True, tag="node.removed"):
    data: NodeRemoved


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


class PolicyConfiguredEvent(Envelope, frozen=True, kw_only=True, tag="policy.configured"):
    data: PolicyConfigured


class ViewDigestEvent(Envelope, frozen=True, kw_only=True, tag="view.digest"):
    data: ViewDigest


Event = (
    ModelDeclaredEvent
    | ModelRemovedEvent
    | QuotaSetEvent
    | ScaleDesiredEvent
    | ModelDemandedEvent
    | NodeInventoryEvent
    | NodeLostEvent
    | NodeFoundEvent
    | NodeCordonedEvent
    | NodeUncordonedEvent
    | NodeRemovedEvent
    | ReplicaStateEvent
    | ReplicaUsedEvent
    | PlacementDecidedEvent
    | PlacementFailedEvent
    | ReplicaStartEvent
    | ReplicaDrainEvent
    | PreemptionDecidedEvent
    | HoldCreatedEvent
    | HoldReleasedEvent
    | PolicyConfiguredEvent
    | ViewDigestEvent
)

EVENT_CLASSES: tuple[type[Envelope], ...] = (
    ModelDeclaredEvent,
    ModelRemovedEvent,
    QuotaSetEvent,
    ScaleDesiredEvent,
    ModelDemandedEvent,
    NodeInventoryEvent,
    NodeLostEvent,
    NodeFoundEvent,
    NodeCordonedEvent,
    NodeUncordonedEvent,
    NodeRemovedEvent,
    ReplicaStateEvent,
    ReplicaUsedEvent,
    PlacementDecidedEvent,
    PlacementFailedEvent,
    ReplicaStartEvent,
    ReplicaDrainEvent,
    PreemptionDecidedEvent,
    HoldCreatedEvent,
    HoldReleasedEvent,
    PolicyConfiguredEvent,
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
