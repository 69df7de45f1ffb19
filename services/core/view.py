"""The cluster view: what the log says the cluster is, after folding it.

Built and changed only by `services.core.fold`; read by the scheduler, the preemption
policy, the projector (which persists it) and the replay tools. No I/O, no clock:
questions that depend on time (is a hold still on? how long has a replica been idle?)
take `now` as a parameter.

The view has two layers. `ViewState` is canonical: plain msgspec structs holding what
the events said (the node reports, model declarations, the quota tree, replicas,
holds, in-flight preemptions, recent decisions). It is what snapshots serialize and
what the digest hashes. `View` adds indexes derived from it (the catalog, the quota
tree, the GPU inventory), rebuilt from the state when a snapshot is loaded, so the
two can never disagree about anything a snapshot would keep.
"""

from __future__ import annotations

import bisect
import hashlib
import operator
from collections.abc import Container, Iterable, Iterator, KeysView
from datetime import datetime, timedelta

import msgspec

from schemas import events as ev
from services.core import catalog, inventory, quota

# SCHEMA versions ViewState. A snapshot written under another number is ignored and
# the view rebuilt from the log: a snapshot trusted across a change of meaning would
# give a view no replay can reproduce. 6: a preemption's pin (`Preempting.domain` and
# `until`), which a view folded before it left unset for a decision that names a domain.
# 7: a multi-node replica's shards stopped one by one (`drained_on`, `stopped_on`).
# 8: a multi-node replica ready with its last shard (`ready_on`), and one whose shard
# failed holding its other shards' GPUs until they stop (`failed_on`).
# 9: a report creates no replica (only a placement does), endpoints on their node's
# `address`, claimed times (`last_used_at`, a demand's `since`) bounded by the event's.
# 10: a replica's engine load (`engine`), from the `replica.used` that carries one.
SCHEMA = 10

# RECENT_DECISIONS bounds the decisions the view keeps. The log holds every one; the
# view keeps enough for `llmgw status` and for a scheduler to see what it last said.
RECENT_DECISIONS = 100
RECENT_REJECTIONS = 100

# LIVE_STATES hold capacity and count towards a model's replicas.
LIVE_STATES = frozenset({"pending", "starting", "loading", "ready"})


# JOURNAL_KEPT is how many of the latest entries a `Journal` reaches back to at least (it
# keeps up to twice as many): a reader further behind starts again.
JOURNAL_KEPT = 1 << 16


class Journal:
    """The replicas changed, by id, in the order of their changes, one as often as it
    changed: what a reader that keeps something per replica reads to catch up without
    looking at every replica (`since`). Only the latest JOURNAL_KEPT are sure to be kept."""

    __slots__ = ("_from", "_items", "count")

    def __init__(self) -> None:
        self.count = 0
        """How many were added: while it stays, nothing was."""
        # _items[i] is entry number _from + i + 1.
        self._items: list[str] = []
        self._from = 0

    def add(self, replica: str) -> None:
        self.count += 1
        items = self._items
        items.append(replica)
        if len(items) > 2 * JOURNAL_KEPT:
            del items[:-JOURNAL_KEPT]
            self._from = self.count - JOURNAL_KEPT

    def since(self, count: int) -> list[str] | None:
        """The replicas added since `count` was `self.count`; None when the journal no
        longer reaches back that far (such a reader starts again)."""
        at = count - self._from
        if at < 0:
            return None
        return self._items[at:]


def after(t: datetime, seconds: float) -> datetime:
    """`seconds` after `t`; the latest time there is when that reaches past it."""
    try:
        return t + timedelta(seconds=seconds)
    except (OverflowError, ValueError):
        return datetime.max.replace(tzinfo=t.tzinfo)


def before(now: datetime, seconds: float) -> datetime:
    """`seconds` before `now`; the earliest time there is when that reaches past it (a
    setting of inf, "for ever", or merely huge)."""
    try:
        return now - timedelta(seconds=seconds)
    except (OverflowError, ValueError):
        return datetime.min.replace(tzinfo=now.tzinfo)


class ReplicaRecord(msgspec.Struct, kw_only=True, gc=False):
    """One replica as the log has described it. Mutable: the fold owns it.

    The view's records are gc=False, like the events: they hold plain values and never
    refer back to what refers to them, so the cycle collector need not walk them.
    """

    id: str
    model: str
    profile: str
    state: str
    shards: tuple[inventory.Shard, ...] = ()
    created_at: datetime
    """Time of its placement.decided (only a placement makes a replica)."""
    updated_at: datetime
    ready_at: datetime | None = None
    """Time of its first `ready`; None while it never was."""
    last_used_at: datetime | None = None
    """Latest replica.used; None when nobody has said, which is not the same as idle."""
    engine: ev.EngineLoad | None = None
    """What its engine last said of its load (the latest `replica.used` carrying it)."""
    retiring_at: datetime | None = None
    """Time of a replica.drain with reason scale_down."""
    preempted_for: str | None = None
    """for_model of a replica.drain with reason preempted."""
    drain_reason: str | None = None
    reason: str | None = None
    """The reason of its latest replica.state (why it failed, for instance)."""
    placed_by: str | None = None
    """Id of the placement.decided that created it."""
    drained_by: str | None = None
    """Id of the replica.drain that asked it to stop."""
    cpu_cores: float = 0.0
    """CPU cores per shard it holds, as allocated (its profile's when it was placed)."""
    memory_gb: float = 0.0
    """Memory per shard it holds, as allocated."""
    endpoint: str | None = None
    """Where its server answers (`http://host:port`): the latest `replica.state` that
    named one. Kept after it stops (the record says where it was); only a ready one is
    routed to."""
    drained_on: tuple[str, ...] = ()
    """The nodes whose command subject holds a `replica.drain` for it, in the order they
    came: one per shard's node, so a decision's drains missing after a crash are known
    node by node (`reaction.missing`)."""
    stopped_on: tuple[str, ...] = ()
    """The nodes whose agent said its shard stopped (a `replica.state` `stopped` naming
    its `node`), in the order they said it. While others still run, the replica keeps
    its state and holds only their shards; the last one stops it."""
    ready_on: tuple[str, ...] = ()
    """The nodes whose agent said its shard ready (a `replica.state` `ready` naming its
    `node`), in the order they said it. A replica with shards on several nodes is ready
    when every one of them has said so, not at the first."""
    failed_on: tuple[str, ...] = ()
    """The nodes whose shard failed (its node lost past the grace, its GPUs gone from the
    node's report, or its agent said `failed`), in the order they failed. A replica with
    shards on several nodes cannot serve without one: it is draining from the first, its
    shards on the other nodes hold their GPUs until their agents say `stopped` (their
    servers still run), and the last of them leaves it failed."""
    failed_by: str | None = None
    """Id of the event that failed its first shard (`failed_on`): what the scheduler's
    drains of its other shards are derived from and caused by. None while none failed."""

    @property
    def holds_capacity(self) -> bool:
        return self.state in ev.HOLDING_STATES

    @property
    def live(self) -> bool:
        """Whether it counts towards its model's replicas: holds capacity, not on its way out.

        Two readings of what the reference leaves to packages we do not have are the
        project's own. A draining replica is on its way out: it holds its GPUs until
        stopped (`holds_capacity`), but it is neither live nor a preemption candidate.
        A replica preempted for another model no longer counts as live for its own: the
        room was given up, and counted, its model would look whole while the room is
        already another's (its minimum, the hold's "satisfied", the scheduler's count).

        A replica drained for placement_timeout never reported starting: the scheduler gave
        up on it and places another, so it counts no more. It still holds its GPUs until
        its agent reports it stopped, because it may yet have started late.
        """
        return (
            self.state in LIVE_STATES
            and self.retiring_at is None
            and self.preempted_for is None
            and self.drain_reason != "placement_timeout"
        )

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.node for s in self.shards))

    def idle_s(self, now: datetime) -> float | None:
        """Seconds since it last served; None when unknown."""
        if self.last_used_at is None:
            return None
        return max((now - self.last_used_at).total_seconds(), 0.0)


class NodeRecord(msgspec.Struct, kw_only=True, gc=False):
    report: ev.NodeInventory
    """The node's latest whole inventory."""
    cordoned: bool = False
    lost: bool = False
    lost_reason: str | None = None
    updated_at: datetime
    failing_at: datetime | None = None
    """Lost with a grace (`node.lost`'s `grace_s`): when its replicas are failed unless
    it is heard from first. None when not lost, or lost and its replicas failed."""


class HoldRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A model that gave up room, kept from taking it back until `until` has passed."""

    model: str
    for_model: str
    until: datetime
    created_at: datetime
    created_by: str
    """Id of the hold.created event."""


class Preempting(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """Victims of a decision for `for_model`, which waits while they are on their way out,
    and the pin of its placement to the domain they free (`View.pin`).

    The pin's fields have defaults and are left out of the encoding while unset, so a
    view folded from a log without them encodes (and digests) as it did before."""

    for_model: str
    victims: tuple[str, ...]
    decision: str
    """Id of the preemption.decided."""
    at: datetime
    domain: str = ""
    """The decision's `domain` (`level=value`) while the pin is on: "" when the decision
    named none, or once a replica of the model was placed since."""
    until: datetime | None = None
    """When the decision's hold ends (as `fold.hold_until` reads a hold), and the pin with
    it; None when the decision named no domain."""


class DecisionRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One decision the control plane published, with its reason."""

    seq: int
    id: str
    time: datetime
    type: str
    model: str
    outcome: str
    summary: str
    causation: str | None = None


class Rejection(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """An event the fold did not apply, and why."""

    seq: int
    id: str
    type: str
    reason: str


class PolicyRecord(msgspec.Struct, kw_only=True, gc=False):
    """The preemption settings the log last recorded (`policy.configured`), and where."""

    settings: ev.PolicyConfigured
    seq: int
    id: str
    time: datetime
    source: str


class DemandRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A model's last `model.demanded`: requests the gateway held for it, as of `at`."""

    waiting: int
    """Requests held then."""
    since: datetime
    """When the longest-held of them arrived."""
    at: datetime
    """The event's time."""
    inflight: int = 0
    """Requests in flight on its replicas then, as the gateway counted."""
    id: str
    """Id of the model.demanded."""
    answered_by: str | None = None
    """Id of the first scale.desired for the model folded after it; None while none is.
    An answered demand wakes nothing again: the count it asked for was decided, and a
    model gone idle since is not woken by a wait that ended long ago."""


class ScaleRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A model's last `scale.desired`, and who asked: what the autoscaler reads to leave
    an operator's count alone, and to date a wake-up."""

    replicas: int
    at: datetime
    id: str
    source: str
    reason: str | None = None
    """The event's `reason`: None when an operator asked by hand."""

    @property
    def by_hand(self) -> bool:
        return self.reason is None


class ViewState(msgspec.Struct, kw_only=True):
    """The canonical view: everything snapshots keep and the digest covers."""

    schema: int = SCHEMA
    seq: int = 0
    """The last stream sequence folded."""
    time: datetime | None = None
    """The time of the last event folded."""
    nodes: dict[str, NodeRecord] = msgspec.field(default_factory=dict)
    models: dict[str, ev.ModelDeclared] = msgspec.field(default_factory=dict)
    quota: tuple[ev.OwnerQuota, ...] = ()
    desired: dict[str, int] = msgspec.field(default_factory=dict)
    """scale.desired as asked, before clamping to the model's [min, max]."""
    scaled: dict[str, ScaleRecord] = msgspec.field(default_factory=dict)
    """Per model (as `desired` keys it) its last scale.desired: when, by whom, why."""
    demand: dict[str, DemandRecord] = msgspec.field(default_factory=dict)
    """Per model (resolved; an unknown name as given) its last model.demanded."""
    replicas: dict[str, ReplicaRecord] = msgspec.field(default_factory=dict)
    holds: dict[str, HoldRecord] = msgspec.field(default_factory=dict)
    preempting: dict[str, Preempting] = msgspec.field(default_factory=dict)
    decisions: list[DecisionRecord] = msgspec.field(default_factory=list)
    rejections: list[Rejection] = msgspec.field(default_factory=list)
    rejected: int = 0
    """How many events were rejected in all."""
    policy: PolicyRecord | None = None
    """The preemption settings last recorded; None when the log holds none (a log from
    before they were recorded, or no preemption service has led yet)."""


def model_of(d: ev.ModelDeclared) -> catalog.Model:
    """The catalog's model for a declaration."""
    return catalog.Model(
        name=d.name,
        owner=d.owner,
        cls=d.cls,
        min=d.min,
        max=-1 if d.max is None else d.max,
        aliases=d.aliases,
        profiles=tuple(
            catalog.Profile(
                name=p.name,
                gpus=p.gpus,
                shards=p.shards,
                gpu_memory_gb=p.gpu_memory_gb,
                gpu_model=p.gpu_model,
                cpu_cores=p.cpu_cores,
                memory_gb=p.memory_gb,
                topology_level=None if p.topology is None else p.topology.level,
                topology_mode="required" if p.topology is None else p.topology.mode,
            )
            for p in d.profiles
        ),
    )


def node_of(rec: NodeRecord) -> inventory.Node:
    """The inventory's node for a node record."""
    r = rec.report
    return inventory.Node(
        name=r.node,
        gpus=r.gpus,
        cpu_cores=r.cpu_cores,
        memory_gb=r.memory_gb,
        labels=r.labels,
        cordoned=rec.cordoned,
        lost=rec.lost,
    )


def quota_tree_of(owners: tuple[ev.OwnerQuota, ...]) -> quota.QuotaTree:
    return quota.QuotaTree(
        quota.Quota(
            name=o.name,
            parent=o.parent,
            guarantee=_amount(o.guarantee),
            limit=None if o.limit is None else _amount(o.limit),
        )
        for o in owners
    )


def _amount(r: ev.Resources) -> quota.Amount:
    return quota.Amount(gpus=r.gpus, cpu_cores=r.cpu_cores, memory_gb=r.memory_gb)


class View:
    """The view with its derived indexes. Change it only through `fold.apply`."""

    __slots__ = (
        "_broken",
        "_current",
        "_current_top",
        "_failed",
        "_failed_at",
        "_failing",
        "_live",
        "_live_ids",
        "_loads",
        "_of_model",
        "_ordinal",
        "_pending",
        "_timed_out",
        "_timed_out_at",
        "_unordered",
        "catalog",
        "folds",
        "inventory",
        "journal",
        "quota",
        "state",
        "uses",
    )

    def __init__(self, state: ViewState | None = None) -> None:
        self.state = state if state is not None else ViewState()
        # folds counts the events folded into this view object, applied or rejected
        # (`fold.apply_rule`): what a reader derives from the view alone holds while it
        # stands (the gateway's routable replicas per model, `routing.LeastInflight`).
        self.folds = 0
        s = self.state
        self.catalog = catalog.Catalog()
        for d in s.models.values():
            self.catalog.put(model_of(d))
        self.quota = quota_tree_of(s.quota)
        self.inventory = inventory.Inventory(node_of(n) for n in s.nodes.values())
        # _failing: the nodes lost with a grace still running (`NodeRecord.failing_at`),
        # kept by the fold (`note_node`) so a pass does not walk every node for them.
        self._failing = {n for n, r in s.nodes.items() if r.failing_at is not None}
        # The replica indexes (see `note`): the view keeps every replica ever placed, and
        # a pass or a policy call that walked them all would cost more each day a cluster
        # runs. They are derived from the records alone, so a view rebuilt from a
        # snapshot has the same.
        self._ordinal: dict[str, int] = {}
        self._current: dict[str, ReplicaRecord] = {}
        self._current_top = -1
        self._unordered = False
        self._of_model: dict[str, dict[str, ReplicaRecord]] = {}
        self._live: dict[str, int] = {}
        self._live_ids: set[str] = set()
        self._pending: dict[str, ReplicaRecord] = {}
        self._broken: dict[str, ReplicaRecord] = {}
        self._failed: list[tuple[datetime, int, str]] = []
        self._failed_at: dict[str, tuple[datetime, int, str]] = {}
        self._timed_out: list[tuple[datetime, int, str]] = []
        self._timed_out_at: dict[str, tuple[datetime, int, str]] = {}
        self._loads: dict[str, list[float]] = {}
        # The replicas changed, for readers that keep something per replica (the
        # policy's index): `journal` every change `note` sees, `uses` a later use alone
        # (`note_use`), which changes nothing else of a replica.
        self.journal = Journal()
        self.uses = Journal()
        for r in s.replicas.values():
            if r.holds_capacity and r.shards:
                a = allocation_of(r)
                if a.shards:
                    self.inventory.restore(a)
            self.note(r, ready=True)

    # The replica indexes, kept by the fold.

    def note(self, r: ReplicaRecord, ready: bool = False) -> None:
        """Bring the replica indexes up to date with `r`, just created or changed. The
        fold calls it after every change to a replica record; nothing else changes them.

        - current: the replicas that hold capacity, in the order they were created, and
          the same per model name as the replica gives it. One that stops leaves it, so
          what reads it (a pass, the policy, quota usage, a lost node's replicas) costs
          what the cluster holds now, not what it ever held;
        - live: per model name as the replica gives it, how many are `live`;
        - pending: the placed replicas still pending and not asked to stop, which a
          pass checks against its start timeout;
        - timed out: the replicas drained for placement_timeout, holding capacity or
          not, by the later of their creation and their first ready. A pass avoids the
          nodes of those created lately, and the first ready of one ends a backoff on
          its node even once it has stopped; read by time, it costs a pass the recent
          ones, however many timed out before;
        - broken: the replicas with a failed shard whose other shards still hold GPUs
          (`failed_on`), which a pass drains on the nodes not asked yet;
        - failed: the failed ones by the time of their last report (a gang with a failed
          shard from that shard's failure: its other shards stopping come later);
        - loads: per model, each replica's seconds from placement to its first ready,
          added when `ready` says this change was that first ready.
        """
        rid = r.id
        self.journal.add(rid)
        n = self._ordinal.get(rid)
        if n is None:
            n = self._ordinal[rid] = len(self._ordinal)
        state = r.state
        self._note_current(r, n, state in ev.HOLDING_STATES)
        self._note_live(r)
        if state == "pending" and r.placed_by is not None and r.drained_by is None:
            self._pending[rid] = r
        else:
            self._pending.pop(rid, None)
        if r.failed_on and state in ev.HOLDING_STATES:
            self._broken[rid] = r
        elif self._broken:
            self._broken.pop(rid, None)
        _move(
            self._failed,
            self._failed_at,
            rid,
            (r.updated_at, n, rid) if state == "failed" or r.failed_on else None,
        )
        if r.drain_reason == "placement_timeout":
            # A drain's reason never changes and its ready_at is set once: the key moves
            # at most once, at a ready after the timeout.
            at = r.created_at if r.ready_at is None else max(r.created_at, r.ready_at)
            _move(self._timed_out, self._timed_out_at, rid, (at, n, rid))
        if ready and r.ready_at is not None:
            self._loads.setdefault(r.model, []).append((r.ready_at - r.created_at).total_seconds())

    def _note_current(self, r: ReplicaRecord, n: int, holding: bool) -> None:
        """The current index of `note`: `r` (created `n`th) joins it while it holds
        capacity, in creation order, and leaves it when it stops."""
        rid = r.id
        name = r.model
        if holding:
            if rid not in self._current:
                if n < self._current_top:
                    self._unordered = True
                else:
                    self._current_top = n
                self._current[rid] = r
                of = self._of_model.get(name)
                if of is None:
                    self._of_model[name] = {rid: r}
                else:
                    of[rid] = r
        elif self._current.pop(rid, None) is not None:
            of = self._of_model[name]
            del of[rid]
            if not of:
                del self._of_model[name]

    def _note_live(self, r: ReplicaRecord) -> None:
        """The live counts of `note`: per model name, how many of its replicas are live."""
        rid = r.id
        name = r.model
        if r.live:
            if rid not in self._live_ids:
                self._live_ids.add(rid)
                self._live[name] = self._live.get(name, 0) + 1
        elif rid in self._live_ids:
            self._live_ids.remove(rid)
            left = self._live[name] - 1
            if left:
                self._live[name] = left
            else:
                del self._live[name]

    def note_use(self, r: ReplicaRecord) -> None:
        """`r` was used later than it was last (its `last_used_at` moved on, and nothing
        else of it): the fold calls it for a `replica.used`, which `note` does not index."""
        self.uses.add(r.id)

    def current(self) -> Iterable[ReplicaRecord]:
        """The replicas that hold capacity, in the order they were created (the order of
        `replicas`): what a pass and the policy read, without the cluster's whole
        history. A replica drained for placement_timeout is here while it holds capacity
        and leaves when it stops, like any other; a pass finds it later by
        `timed_out_since`."""
        if self._unordered:
            order = self._ordinal
            self._current = dict(sorted(self._current.items(), key=lambda kv: order[kv[0]]))
            self._unordered = False
        return self._current.values()

    def current_of(self, model: str) -> Iterable[ReplicaRecord]:
        """The current replicas (see `current`) whose model is `model` as they give it,
        in no set order."""
        of = self._of_model.get(model)
        return () if of is None else of.values()

    def current_models(self) -> KeysView[str]:
        """The model names, as replicas give them, that some current replica gives."""
        return self._of_model.keys()

    def pending_placed(self) -> list[ReplicaRecord]:
        """The placed replicas still pending and not asked to stop, in the order they
        were created: the ones a pass may find past its start timeout."""
        pending = self._pending  # by replica id
        return [pending[rid] for rid in sorted(pending, key=self._ordinal.__getitem__)]

    def broken(self) -> list[ReplicaRecord]:
        """The replicas with a failed shard whose other shards still hold their GPUs
        (`ReplicaRecord.failed_on`), in the order they were created."""
        broken = self._broken  # by replica id
        return [broken[rid] for rid in sorted(broken, key=self._ordinal.__getitem__)]

    def ordinal(self, replica: str) -> int:
        """Where a replica comes in the order replicas were created (the order of
        `replicas`)."""
        return self._ordinal[replica]

    def failed_since(self, since: datetime) -> list[ReplicaRecord]:
        """The failed replicas (and gangs with a failed shard, `failed_on`) whose last
        report is at or after `since`, in the order they were created."""
        return self._since(self._failed, since)

    def note_node(self, rec: NodeRecord) -> None:
        """Bring the node index up to date with `rec`, just created or changed; the fold
        calls it after each change to a node's `failing_at`."""
        if rec.failing_at is None:
            self._failing.discard(rec.report.node)
        else:
            self._failing.add(rec.report.node)

    def failing_nodes(self, now: datetime) -> list[str]:
        """The lost nodes whose grace has passed by `now` with their replicas not failed
        yet (`NodeRecord.failing_at`), by name."""
        if not self._failing:
            return []
        nodes = self.state.nodes
        return sorted(
            n for n in self._failing if (at := nodes[n].failing_at) is not None and at <= now
        )

    def timed_out_since(self, since: datetime) -> list[ReplicaRecord]:
        """The replicas drained for placement_timeout, holding capacity or not, whose
        creation or first ready is at or after `since`, in the order they were created.
        A reader that needs those created after one time, or first ready after another,
        reads from the earlier of the two, and no further back."""
        return self._since(self._timed_out, since)

    def _since(
        self, index: list[tuple[datetime, int, str]], since: datetime
    ) -> list[ReplicaRecord]:
        """The replicas of a time index (see `_move`) keyed at or after `since`, in the
        order they were created."""
        i = bisect.bisect_left(index, (since, -1, ""))
        reps = self.state.replicas
        return [reps[rid] for _, _, rid in sorted(index[i:], key=operator.itemgetter(1))]

    def load_times(self) -> dict[str, list[float]]:
        """Per model, each replica's seconds from placement to its first ready (read
        only)."""
        return self._loads

    # Reading.

    @property
    def seq(self) -> int:
        return self.state.seq

    @property
    def replicas(self) -> dict[str, ReplicaRecord]:
        return self.state.replicas

    def replicas_of(self, model: str) -> Iterator[ReplicaRecord]:
        return (r for r in self.state.replicas.values() if r.model == model)

    def live_count(self, model: str) -> int:
        """How many replicas of a model hold capacity and are not on their way out (by
        the name the replicas give, not resolved; `live_of` counts a declared model)."""
        return self._live.get(model, 0)

    def live_for(self, model: str) -> int:
        """`live_of` the model a name or alias resolves to; for a name no declared model
        has, the replicas that give it."""
        m = self.catalog.resolve(model)
        return self.live_count(model) if m is None else self.live_of(m)

    def live_of(self, m: catalog.Model) -> int:
        """How many replicas of a declared model are live, under its name or an alias
        that names it: replicas placed before a model was renamed run under its old
        name, and they are its replicas all the same. What the pass, the end of a hold
        and the policy's minimum count."""
        live = self._live
        if not m.aliases:
            return live.get(m.name, 0)
        return sum(live.get(n, 0) for n in self.catalog.names_of(m))

    def desired_for(self, model: str) -> int:
        """scale.desired clamped to [min, max], else min; 0 for an unknown model."""
        m = self.catalog.resolve(model)
        return 0 if m is None else self.desired_of(m)

    def desired_of(self, m: catalog.Model) -> int:
        """`desired_for` a model already resolved."""
        return _desired(self.state.desired.get(m.name), m.min, m.max)

    def off_target(self) -> tuple[list[str], list[tuple[int, catalog.Model, int, int]]]:
        """The declared models in rank order (`Catalog.by_rank`), split in two: the names
        of those whose `live_of` is their `desired_of`, and each other one with its live
        and desired counts, after how many of the first it comes in rank order. What a
        pass reads of every model, in one loop rather than two calls per model."""
        live = self._live
        asked_of = self.state.desired
        cat = self.catalog
        on: list[str] = []
        off: list[tuple[int, catalog.Model, int, int]] = []
        for m in cat.by_rank():
            desired = _desired(asked_of.get(m.name), m.min, m.max)
            names = cat.names_of(m) if m.aliases else (m.name,)
            n = sum([live.get(a, 0) for a in names]) if len(names) > 1 else live.get(m.name, 0)
            if n == desired:
                on.append(m.name)
            else:
                off.append((len(on), m, n, desired))
        return on, off

    def active_hold(self, model: str, now: datetime) -> HoldRecord | None:
        """The hold keeping a model from taking room back, if one is still on (see
        `hold_end`)."""
        h = self.state.holds.get(model)
        if h is None or self.hold_end(h.for_model, h.until, now) is not None:
            return None
        return h

    def hold_end(self, for_model: str, until: datetime, now: datetime) -> str | None:
        """Why a hold given to `for_model` until `until` has ended at `now`; None while it
        is on. The one rule for when a hold ends, for the policy, the scheduler and the
        release of holds alike.

        A hold ends once `now` is past its `until` ("expired"): at `until` exactly it is
        still on, as in the reference's isHeld (`now.After(h.Until)`), so the policy, the
        release of holds, `llmgw status` and `llmgw explain` all agree with it on the
        instant. It ends early once the model it was given to has what it asked for, its
        live count at its desired count ("satisfied"): past that, keeping the room from
        the held model only leaves it idle.
        """
        if now > until:
            return "expired"
        to = self.catalog.resolve(for_model)
        if to is not None and self.live_of(to) >= self.desired_of(to):
            return "satisfied"
        return None

    def pin(self, model: str, now: datetime) -> Preempting | None:
        """The preemption whose domain the model's placement is kept in at `now`, if one
        is on: from a `preemption.decided` (preempted, with a `domain`) until a replica of
        the model is placed (the fold clears `domain`) or the decision's hold ends by the
        one rule for holds (`hold_end`: past its `until`, or the model has what it asked
        for). Its victims free room in that domain; placed elsewhere meanwhile, the model
        would leave that room to others and the evictions would be wasted."""
        p = self.state.preempting.get(model)
        if p is None or not p.domain or p.until is None:
            return None
        if self.hold_end(p.for_model, p.until, now) is not None:
            return None
        return p

    def awaiting(self, model: str) -> tuple[str, ...]:
        """Victims stopped for a model that still hold capacity: it waits for them
        rather than stopping more."""
        p = self.state.preempting.get(model)
        if p is None:
            return ()
        reps = self.state.replicas
        return tuple(v for v in p.victims if v in reps and reps[v].holds_capacity)

    def holdings(self, owners: Container[str] | None = None) -> list[quota.Holding]:
        """What every replica holding capacity holds, for quota math; with `owners`,
        only the replicas of those owners' models (in the same order)."""
        out = []
        # Per model its owner, and per shape the amount size_of gives: resolved once per
        # model and shape rather than once per replica.
        by_model: dict[str, str] = {}
        amounts: dict[tuple[str, str, int, int], quota.Amount] = {}
        for r in self.current():
            owner = by_model.get(r.model)
            if owner is None:
                m = self.catalog.resolve(r.model)
                owner = by_model[r.model] = m.owner if m is not None else "default"
            if owners is not None and owner not in owners:
                continue
            shards = r.shards
            gpus = len(shards[0].gpus) if len(shards) == 1 else sum(len(s.gpus) for s in shards)
            key = (r.model, r.profile, gpus, len(shards))
            amount = amounts.get(key)
            if amount is None:
                amount = amounts[key] = size_of(self, r)
            out.append(
                quota.Holding(replica=r.id, owner=owner, amount=amount, created_at=r.created_at)
            )
        return out

    # Copies, snapshots, digests.

    def copy(self) -> View:
        """An independent copy (through the snapshot encoding)."""
        return View(decode_state(encode_state(self.state)))


def _desired(asked: int | None, lo: int, hi: int) -> int:
    """What a model's scale.desired (None: never said) asks for, clamped to its min and
    max (a catalog's max is never below its min)."""
    return lo if asked is None else min(max(asked, lo), hi)


def _move(
    index: list[tuple[datetime, int, str]],
    keys: dict[str, tuple[datetime, int, str]],
    rid: str,
    key: tuple[datetime, int, str] | None,
) -> None:
    """Put `rid` at `key` in a list kept sorted by time (`keys`: where each one is), or
    take it out when `key` is None."""
    old = keys.get(rid)
    if old == key:
        return
    if old is not None:
        del index[bisect.bisect_left(index, old)]
        del keys[rid]
    if key is not None:
        bisect.insort(index, key)
        keys[rid] = key


def profile_of(view: View, r: ReplicaRecord) -> catalog.Profile | None:
    m = view.catalog.resolve(r.model)
    return None if m is None else m.profile(r.profile)


def size_of(view: View, r: ReplicaRecord) -> quota.Amount:
    """What stopping a replica frees: its GPUs, and its profile's CPU and memory per shard."""
    p = profile_of(view, r)
    gpus = sum(len(s.gpus) for s in r.shards)
    n = len(r.shards)
    if p is None:
        return quota.Amount(gpus=gpus)
    return quota.Amount(gpus=gpus, cpu_cores=p.cpu_cores * n, memory_gb=p.memory_gb * n)


def allocate(view: View, r: ReplicaRecord) -> str | None:
    """Record in the inventory what a replica holds; returns why it cannot, else None.

    The CPU and memory per shard come from its profile as declared now, and are kept
    on the record: a model re-declared later with other sizes does not change what its
    running replicas hold, and a view rebuilt from a snapshot allocates exactly what the
    live one did.
    """
    p = profile_of(view, r)
    cpu, mem = (0.0, 0.0) if p is None else (p.cpu_cores, p.memory_gb)
    why = view.inventory.try_allocate(
        inventory.Allocation(replica=r.id, shards=r.shards, cpu_cores=cpu, memory_gb=mem)
    )
    if why is None:
        r.cpu_cores, r.memory_gb = cpu, mem
    return why


def allocation_of(r: ReplicaRecord) -> inventory.Allocation:
    """What a replica holds, as recorded when it was allocated, less the shards whose
    agents said they stopped (`stopped_on`) and those that failed (`failed_on`)."""
    shards = r.shards
    if r.stopped_on or r.failed_on:
        gone = r.stopped_on + r.failed_on
        shards = tuple(s for s in shards if s.node not in gone)
    return inventory.Allocation(
        replica=r.id, shards=shards, cpu_cores=r.cpu_cores, memory_gb=r.memory_gb
    )


_state_encoder = msgspec.json.Encoder(order="sorted")
_state_decoder = msgspec.json.Decoder(ViewState)


def encode_state(state: ViewState) -> bytes:
    """The canonical encoding: sorted keys, msgspec's fixed number and time formats."""
    return _state_encoder.encode(state)


def decode_state(raw: bytes) -> ViewState:
    return _state_decoder.decode(raw)


def digest(state: ViewState) -> str:
    """A stable hash of the view: two processes on two machines agree on it."""
    return hashlib.blake2b(encode_state(state), digest_size=16).hexdigest()
