"""The scheduler's decisions: one reconcile pass over a view, as the events to publish.

Called by `services.scheduler.service.Scheduler` on every relevant event and on a tick,
and by the benchmark on its own. Plain functions over a `View`, the time `now`, and what
the scheduler remembers of its last failures; no I/O, no asyncio, no wall clock. It never
changes the view: placements within a pass are tried on a clone of the inventory. What
the module keeps between calls (placements that found nothing, by inventory version; each
model's last one with its reasons and digest; the print of the cluster and its rows;
failure digests), and what the view keeps of its
last count of the models (`View.off_target`), saves work, never changes an answer.

Failed starts back off: a replica that failed before it was ever ready keeps its model
off the node it failed on for a delay that doubles with each retry that failed again, up
to a cap. The delay is derived from the failed replicas the view keeps, so any scheduler
on the same log reaches the same decision, and `placement.failed` names the nodes.

Every output's id is derived from stable inputs (the view's sequence and time, the model,
the slot), so two schedulers deciding on the same view publish the same ids and
JetStream's duplicate window keeps one copy.
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import msgspec

from schemas import events as ev
from schemas import ids
from services.core import catalog, inventory, placement, quota
from services.core.view import Preempting, ReplicaRecord, View, before

# DRAIN_GRACE_S: the contract's (schemas.events), for the scheduler's drains.
DRAIN_GRACE_S = ev.DRAIN_GRACE_S


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The scheduler's knobs: one field each, its default and its help text, from which
    the flags of `llmgw up` and `python -m services.scheduler` are made."""

    tick_s: float = field(
        default=1.0,
        metadata={
            "positive": True,
            "help": "a pass runs at least this often; heartbeats are checked as often",
        },
    )
    node_timeout_s: float = field(
        default=15.0,
        metadata={
            "positive": True,
            "help": "a node whose heartbeats stop this long is reported lost, once",
        },
    )
    lost_grace_s: float = field(
        default=60.0,
        metadata={
            "help": "a lost node's replicas keep their GPUs this long (its agent may still "
            "serve them) and fail only if it is not heard from again by then; 0 fails "
            "them at once",
        },
    )
    start_timeout_s: float = field(
        default=120.0,
        metadata={
            "positive": True,
            "help": "a placement with no `starting` this long is drained and placed again "
            "elsewhere",
        },
    )
    failed_backoff_s: float = field(
        default=60.0,
        metadata={
            "positive": True,
            "help": "an unchanged placement.failed is reported again after this long, then "
            "after twice as long each time",
        },
    )
    failed_backoff_max_s: float = field(
        default=3600.0,
        metadata={
            "positive": True,
            "help": "the longest an unchanged placement.failed waits to be reported again",
        },
    )
    failed_quiet_s: float = field(
        default=5.0,
        metadata={
            "help": "a model's placement.failed is reported at most this often, however "
            "often what it was decided on changes",
        },
    )
    start_backoff_s: float = field(
        default=10.0,
        metadata={
            "positive": True,
            "help": "after a failed start the model is kept off that node this long, twice "
            "as long after each retry that fails again",
        },
    )
    start_backoff_max_s: float = field(
        default=300.0,
        metadata={
            "positive": True,
            "help": "the longest a model is kept off a node where its starts failed",
        },
    )
    max_placements_per_pass: int = field(
        default=500,
        metadata={
            "help": "placements one pass decides at most; the rest follow in the next pass",
            "flag": "--max-placements",
        },
    )
    avoid_for_s: float = field(
        default=600.0,
        metadata={"help": "nodes where a placement timed out are avoided this long"},
    )
    drain_grace_s: float = field(
        default=DRAIN_GRACE_S,
        metadata={"help": "grace a drained replica gets to finish its requests"},
    )
    lease_ttl_s: float = field(
        default=5.0,
        metadata={
            "positive": True,
            "help": "a standby takes over at most this long after the leader dies",
        },
    )
    autoscale: bool = True
    """Whether the scheduler runs the autoscaler (`services.core.autoscale`) before each
    pass, scaling on-demand models from the gateway's demand and their use. Off, their
    counts are the operator's alone."""


@dataclass(frozen=True, slots=True)
class Failure:
    """What the scheduler last said about a model it could not place: the digest of what
    it was decided on ("" once the model was placed since), when, and how many times in a
    row it was said again unchanged."""

    digest: str
    at: datetime
    repeats: int = 0

    def cleared(self) -> Failure:
        """The memory of a model placed since: its next failure is news, but still waits
        out the quiet period after this one."""
        return Failure("", self.at)


class Output(msgspec.Struct, frozen=True, gc=False):
    """One event to publish, the node whose command subject it goes on (commands only),
    and the model whose failure memory it updates (placement.failed only). A struct
    rather than a frozen dataclass: a pass makes one per event, and it is made in a
    fraction of the time."""

    event: ev.Event
    node: str | None = None
    failure: tuple[str, Failure] | None = None


@dataclass(slots=True)
class Plan:
    outputs: list[Output] = field(default_factory=list)
    placed: int = 0
    failed: int = 0
    drained: int = 0
    lost: int = 0
    found: int = 0
    satisfied: list[str] = field(default_factory=list)
    """Models with all they want this pass (those that had it, those it placed in full),
    in rank order, whose failure memory can be forgotten."""


# ------------------------------------------------------------------ ids

_SLUG = re.compile(r"[^A-Za-z0-9_-]+")


def _ms(t: datetime | None) -> int:
    return 0 if t is None else max(int(t.timestamp() * 1000), 0)


def _anchor(t: datetime | None, key: str) -> str:
    """A ULID made of a time and a key: a stable parent for derived ids that still sort
    by time."""
    return ids.ulid(_ms(t), hashlib.blake2b(key.encode(), digest_size=10).digest())


def view_token(view: View) -> str:
    """The parent id of every decision taken on this view: the same for any process
    that has folded the same log up to the same sequence."""
    return _anchor(view.state.time, f"view\x00{view.seq}")


def replica_id(model: str, placement_id: str) -> str:
    """`<model-token>-<short hash>`: readable in logs, derived from the placement."""
    slug = _SLUG.sub("-", model).strip("-")[:64] or "model"
    return f"{slug}-{hashlib.blake2b(placement_id.encode(), digest_size=6).hexdigest()}"


# ------------------------------------------------------------------ the pass


def plan(
    view: View,
    now: datetime,
    config: Config,
    *,
    failures: Mapping[str, Failure] | None = None,
    silent: Mapping[str, float] | None = None,
    heard: Collection[str] = (),
    source: str = "scheduler",
    memo: Memo | None = None,
) -> Plan:
    """Everything one pass decides on `view` at `now`.

    `memo`: what the caller keeps from pass to pass (`Memo`); without one, nothing is
    kept past this pass, and the pass decides the same.

    `failures`: per model, the last placement.failed this scheduler published.
    `silent`: per node not lost, seconds since its last heartbeat (as the shell
    measured it). `heard`: the lost nodes whose agent was heard from since.
    """
    out = Plan()
    mk = _Maker(now, source)
    _found_nodes(out, mk, view, heard)
    _lost_nodes(out, mk, view, now, silent or {}, heard, config)
    if out.lost:
        # A lost node fails its replicas in the fold. Placing before that is folded would
        # count them live and place on a node that is gone; the next pass sees it all.
        return out
    # late: per model name as the replicas give it, the placements drained for
    # placement_timeout that a pass may still read. Their nodes are avoided for
    # avoid_for_s after they were created (`_avoided`); a first ready ends a backoff
    # only when it came after the last failure, and a backoff still on now had that
    # failure less than start_backoff_max_s ago (`_backoffs`). An older one changes
    # neither, and the view keeps them by the later of the two times, so the old ones
    # are not read at all.
    recent_s = max(config.avoid_for_s, config.start_backoff_max_s)
    late: dict[str, list[ReplicaRecord]] = {}
    for r in view.timed_out_since(before(now, recent_s)):
        late.setdefault(r.model, []).append(r)
    others, timed_out = _other_names(out, mk, view, now, config, late.keys())
    _broken_gangs(out, mk, view, config)
    failed_starts: _FailedStarts = {}
    for r in view.failed_since(before(now, _horizon_s(config))):
        _note_failed_start(failed_starts, view, r)
    kept = memo if memo is not None else Memo()
    pass_ = _Pass(out, mk, view, now, config, failures or {}, failed_starts, late, kept)
    # Most models have what they want: the loop over the catalog gives their names apart,
    # and only the others are reconciled. `satisfied` is in rank order: the models placed
    # in full (which reconcile adds, in rank order) go back among the others.
    on, off = view.off_target()
    for _, m, n_live, desired in off:
        name = m.name
        if name in timed_out:
            continue
        aliases = others.get(name) if others else None
        pass_.reconcile(m, [name, *aliases] if aliases else (name,), n_live, desired)
    full = out.satisfied
    if full:
        at = {m.name: pos for pos, m, _, _ in off}
        merged: list[str] = []
        done = 0
        for name in full:
            pos = at[name]
            merged += on[done:pos]
            merged.append(name)
            done = pos
        merged += on[done:]
        on = merged
    out.satisfied = [name for name in on if name not in timed_out] if timed_out else on
    return out


def _found_nodes(out: Plan, mk: _Maker, view: View, heard: Collection[str]) -> None:
    """A `node.found` for every lost node heard from again, by name."""
    nodes = view.state.nodes
    for node in sorted(heard):
        rec = nodes.get(node)
        if rec is None or not rec.lost:
            continue
        parent = _anchor(rec.updated_at, f"node\x00{node}\x00{rec.updated_at.isoformat()}")
        found = ev.NodeFound(node=node, reason="heartbeat heard again")
        out.outputs.append(Output(mk(found, ids.derived(parent, "node.found"))))
        out.found += 1


def _lost_nodes(
    out: Plan,
    mk: _Maker,
    view: View,
    now: datetime,
    silent: Mapping[str, float],
    heard: Collection[str],
    config: Config,
) -> None:
    """A `node.lost` for every node silent past the timeout and not yet lost, with the
    grace its replicas get (`lost_grace_s`); and a second, with none, for every lost
    node whose grace has passed and that was not heard from: that one fails its
    replicas. By name."""
    nodes, timeout = view.state.nodes, config.node_timeout_s
    due = []
    for node, secs in silent.items():
        if not secs < timeout:  # (a NaN counts as past it, as it always did)
            rec = nodes.get(node)
            if rec is not None and not rec.lost:
                due.append((node, secs, rec))
    if len(due) > 1:
        due.sort(key=operator.itemgetter(0))
    for node, secs, rec in due:
        parent = _anchor(rec.updated_at, f"node\x00{node}\x00{rec.updated_at.isoformat()}")
        lost = ev.NodeLost(
            node=node, reason=f"no heartbeat for {secs:.0f}s", grace_s=config.lost_grace_s
        )
        out.outputs.append(Output(mk(lost, ids.derived(parent, "node.lost"))))
        out.lost += 1
    for node in view.failing_nodes(now):
        if node in heard:
            continue
        rec = nodes[node]
        at = rec.failing_at
        assert at is not None
        parent = _anchor(at, f"node\x00{node}\x00failing\x00{at.isoformat()}")
        # The first loss's reason says how long it was silent then, not now: say when
        # the grace ended, so "no heartbeat for 16s" is not read as the silence of now.
        lost = ev.NodeLost(
            node=node,
            reason=f"not heard from within the grace, over at {at:%H:%M:%S}Z "
            f"(it was lost for: {rec.lost_reason})",
        )
        out.outputs.append(Output(mk(lost, ids.derived(parent, "node.lost"))))
        out.lost += 1


def _other_names(
    out: Plan,
    mk: _Maker,
    view: View,
    now: datetime,
    config: Config,
    late: Collection[str],
) -> tuple[dict[str, list[str]], set[str]]:
    """Per declared model, the names other than its own (its aliases) given by its
    current replicas or its recent timed-out placements (`late`: the names those give);
    and the models one of whose placements just timed out, drained here and left for
    the next pass. Replicas of models no longer in the catalog are drained.

    The view indexes the current replicas and their live counts by the name they give,
    and the pending placements apart, so a pass reads per name rather than walking
    every replica: a model with all it wants costs its live count alone."""
    others: dict[str, list[str]] = {}
    timed_out: set[str] = set()
    # drains: (creation order, replica, reason), emitted in the order the replicas were
    # created, as a walk over them would.
    drains: list[tuple[int, ReplicaRecord, ev.DrainReason]] = []
    cat = view.catalog
    # A declared model's name resolves to that model (a name wins over an alias): only
    # the other names need resolving.
    declared = view.state.models.keys()
    current = view.current_models()
    # Mostly every name a replica gives is declared: known without making a set.
    names = set() if current <= declared else current - declared
    if late:
        names.update([name for name in late if name not in declared])
    for name in sorted(names):
        m = cat.resolve(name)
        if m is None:
            for r in view.current_of(name):  # each holds capacity
                if r.drained_by is None and r.state != "draining":
                    drains.append((view.ordinal(r.id), r, "model_removed"))
        else:
            others.setdefault(m.name, []).append(name)
    for r in view.pending_placed():
        m = cat.resolve(r.model)
        if m is not None and (now - r.created_at).total_seconds() >= config.start_timeout_s:
            drains.append((view.ordinal(r.id), r, "placement_timeout"))
            timed_out.add(m.name)
    if drains:
        drains.sort(key=operator.itemgetter(0))
        for _, r, why in drains:
            _drain(out, mk, r.id, r.model, r.placed_by, r.nodes, why, config)
    return others, timed_out


def _broken_gangs(out: Plan, mk: _Maker, view: View, config: Config) -> None:
    """A `replica.drain` (`shard_failed`) to each node of a replica with a failed shard
    (`ReplicaRecord.failed_on`) whose own shard still runs and was not asked to stop,
    in the order the replicas were created. Each is caused by the event that failed the
    first shard (`failed_by`), and its id derived from that one's, the replica and the
    node: any scheduler, on any view since, asks each node once.

    The gang cannot serve without the failed shard, and the others' servers hold their
    GPUs until their agents stop them: nobody else would, and the view keeps those GPUs
    held until each says `stopped`."""
    for r in view.broken():
        if r.drained_by is not None and not r.drained_on:
            continue  # asked, on nodes the view was not told (folded without subjects)
        gone = r.stopped_on + r.failed_on + r.drained_on
        nodes = tuple(n for n in r.nodes if n not in gone)
        if nodes:
            cause = r.failed_by or r.placed_by
            _drain(out, mk, r.id, r.model, cause, nodes, "shard_failed", config)


# ------------------------------------------------------------------ failed starts

# _FailedStarts: per model and node, each recent failed start there as (placed at, failed
# at), in no set order.
_FailedStarts = dict[str, dict[str, list[tuple[datetime, datetime]]]]


@dataclass(frozen=True, slots=True)
class Backoff:
    """A node a model is kept off after its starts there failed: until when, and after
    how many failed rounds in a row."""

    node: str
    until: datetime
    rounds: int

    def note(self) -> str:
        s = "" if self.rounds == 1 else "s"
        return f"{self.node} backing off until {self.until:%H:%M:%S} after {self.rounds} failed start{s}"


def start_delay_s(rounds: int, config: Config) -> float:
    """How long a model is kept off a node after `rounds` failed starts in a row there."""
    return min(
        config.start_backoff_s * 2.0 ** min(max(rounds - 1, 0), 62), config.start_backoff_max_s
    )


def _horizon_s(config: Config) -> float:
    """How far back a failed start can still count: far enough for the longest run of
    failed rounds that the delay stops growing at, each at most two caps apart."""
    ratio = config.start_backoff_max_s / config.start_backoff_s
    if not math.isfinite(ratio):
        return math.inf  # a cap of inf: every failed start counts
    steps = math.ceil(math.log2(max(ratio, 1.0)))
    return (steps + 2) * 2.0 * config.start_backoff_max_s


def _note_failed_start(failed: _FailedStarts, view: View, r: ReplicaRecord) -> None:
    """Record `r` when it is a failed start: placed, never ready, not asked to stop, and
    not failed because its node was lost (the node's return is no reason to wait)."""
    if (
        r.placed_by is None
        or r.ready_at is not None
        or (r.drained_by is not None and r.drain_reason != "shard_failed")
        or not r.shards
        or (r.reason is not None and r.reason.startswith("node lost"))
    ):
        return
    m = view.catalog.resolve(r.model)
    if m is None:
        return
    by_node = failed.setdefault(m.name, {})
    # A gang's failed start is its failed shards' nodes' (the others were drained for it).
    for node in r.failed_on or r.nodes:
        by_node.setdefault(node, []).append((r.created_at, r.updated_at))


def _backoffs(
    failed: Mapping[str, list[tuple[datetime, datetime]]],
    reps: Iterable[ReplicaRecord],
    now: datetime,
    config: Config,
) -> dict[str, Backoff]:
    """The nodes a model is kept off at `now`, by node, from its failed starts there.

    A round is the failed starts placed before the previous failure was known (replicas
    placed together); a retry placed within the delay plus the cap after the previous
    failure is the next round, one placed later starts again from the first. A replica of
    the model that came up on the node since its last failure ends the backoff there.
    """
    out: dict[str, Backoff] = {}
    for node, starts in failed.items():
        rounds, last = 0, None
        for placed, at in sorted(starts, key=lambda s: (s[1], s[0])):
            if last is None:
                rounds = 1
            elif placed >= last:
                gap = (placed - last).total_seconds()
                within = start_delay_s(rounds, config) + config.start_backoff_max_s
                rounds = rounds + 1 if gap <= within else 1
            last = at if last is None else max(last, at)
        assert last is not None  # Invariant: a key is only made with a failure.
        if any(r.ready_at is not None and r.ready_at > last and node in r.nodes for r in reps):
            continue
        until = last + timedelta(seconds=start_delay_s(rounds, config))
        if now < until:
            out[node] = Backoff(node, until, rounds)
    return out


class _Pass:
    """What one pass shares across models: the outputs, the inventory placements are tried
    on and the owners' usage, both made only when a model needs placing, and the parent
    id of its decisions, made only when it decides something.

    The inventory is the view's own until a placement is taken: reading it is reading a
    clone of it (same nodes, same version), and a pass where nothing fits copies nothing.
    `owned` tells whether `inv` is the pass's own copy, which takes the allocations."""

    __slots__ = (
        "_parent",
        "config",
        "failed_starts",
        "failures",
        "inv",
        "late",
        "memo",
        "mk",
        "now",
        "out",
        "owned",
        "usage",
        "view",
    )

    def __init__(
        self,
        out: Plan,
        mk: _Maker,
        view: View,
        now: datetime,
        config: Config,
        failures: Mapping[str, Failure],
        failed_starts: _FailedStarts,
        late: Mapping[str, list[ReplicaRecord]],
        memo: Memo,
    ) -> None:
        self.memo = memo
        self.out = out
        self.late = late
        self.failed_starts = failed_starts
        self.mk = mk
        self.view = view
        self.now = now
        self.config = config
        self.failures = failures
        self._parent: tuple[str, int] | None = None
        self.inv: inventory.Inventory = view.inventory
        self.owned = False
        self.usage: dict[str, quota.Amount] | None = None

    def parent(self) -> tuple[str, int]:
        """The parent of the pass's decisions, `view_token`, and the time the ids derived
        from it keep (see `ids.kept_ms`): made the first time a decision needs them."""
        got = self._parent
        if got is None:
            token = view_token(self.view)
            got = self._parent = (token, ids.kept_ms(token))
        return got

    def own(self) -> inventory.Inventory:
        """The pass's own copy of the inventory, made before its first allocation."""
        if not self.owned:
            self.inv = self.inv.clone()
            self.owned = True
        return self.inv

    def reconcile(self, m: catalog.Model, names: Iterable[str], n_live: int, desired: int) -> None:
        """Drain what is above desired, or place what is missing, for one model whose
        current replicas and recently timed-out placements give `names`, `n_live` of
        them live, not `desired`."""
        out, view = self.out, self.view
        # The records are read, not copied: a pass folds nothing, so they stay as they
        # are until it ends.
        if n_live > desired:
            live = [r for n in names for r in view.current_of(n) if r.live]
            for v in _scale_down_order(live)[: n_live - desired]:
                _drain(out, self.mk, v.id, m.name, v.placed_by, v.nodes, "scale_down", self.config)
            return
        if view.active_hold(m.name, self.now) is not None or view.awaiting(m.name):
            return
        if self.usage is None:
            # Usage is read only against a limit (within_limit, and the print of a
            # quota_limit failure): with no limit anywhere, summing it is not needed.
            tree = view.quota
            self.usage = tree.usage(view.holdings()) if tree.limited else {}
        late = [r for n in names for r in self.late.get(n, ())] if self.late else []
        starts = self.failed_starts.get(m.name)
        if starts is None:
            blocked: dict[str, Backoff] = {}
        else:
            reps = [r for n in names for r in view.current_of(n)]
            # A timed-out placement that holds capacity is in both lists: read twice, it
            # still ends a backoff once.
            blocked = _backoffs(starts, [*reps, *late], self.now, self.config)
        _place_missing(
            self,
            m,
            self.usage,
            n_live,
            desired,
            # With neither, nothing to avoid: spared the call on every pass of a model
            # that keeps failing.
            _avoided(late, self.now, self.config, starts) if late or starts else (),
            blocked,
            view.pin(m.name, self.now),
        )


def _scale_down_order(live: list[ReplicaRecord]) -> list[ReplicaRecord]:
    """Which live replicas to drain first when a model has too many.

    Not yet ready before ready (the least invested); then the least recently used, where
    a replica nobody has reported used counts as just used (unknown is not idle); then the
    newest, which is the one above the minimum.
    """
    far = datetime.max.replace(tzinfo=live[0].created_at.tzinfo) if live else None

    def key(r: ReplicaRecord) -> tuple[bool, datetime, float, str]:
        used = r.last_used_at if r.last_used_at is not None else far
        assert used is not None
        return (r.state == "ready", used, -r.created_at.timestamp(), r.id)

    return sorted(live, key=key)


def _avoided(
    timed_out: list[ReplicaRecord],
    now: datetime,
    config: Config,
    failed: Mapping[str, object] | None = None,
) -> tuple[str, ...]:
    """Nodes where a placement of this model timed out lately (of `timed_out`, its
    placements drained for placement_timeout, those created within `avoid_for_s`), or
    where its start failed lately (`failed`, its recent failed starts by node): placed
    elsewhere if it can.

    The failed starts are avoided beyond their backoff: a backoff shorter than a pass
    would otherwise let a model go back and forth between two nodes that refuse it while
    a third, never tried, would serve it."""
    out: set[str] = set(failed or ())
    for r in timed_out:
        if (now - r.created_at).total_seconds() < config.avoid_for_s:
            out.update(r.nodes)
    return tuple(sorted(out))


def _place_missing(
    pass_: _Pass,
    m: catalog.Model,
    usage: dict[str, quota.Amount],
    live: int,
    desired: int,
    avoid: tuple[str, ...],
    blocked: Mapping[str, Backoff],
    pin: Preempting | None = None,
) -> None:
    """Place the model's missing replicas, or report why the next one cannot be.

    `pin`: the preemption whose domain the model's placement is kept in (`View.pin`),
    for its next replica only: once one is placed the pin ends (the fold ends it too),
    and the replicas after it go wherever they fit. A pinned placement is decided
    afresh, never from the memos, which know nothing of pins."""
    out, mk, view, now, config = pass_.out, pass_.mk, pass_.view, pass_.now, pass_.config
    failures, parent = pass_.failures, pass_.parent
    tree = view.quota
    # pick: what placement may choose from. Nodes the model backs off from are cordoned
    # there for it alone (a hard rule, unlike `avoid`); allocations go to both.
    pick = pass_.inv
    if blocked:
        pick = pick.clone()
        for node in blocked:
            pick.set_cordoned(node, True)
        avoided = tuple(sorted({*avoid, *blocked}))
    else:
        avoided = avoid
    for slot in range(desired - live):
        # max_placements_per_pass keeps a pass short: a scale-up of thousands decided in
        # one pass can outlast the leader's lease, which throws the pass away, again and
        # again. The rest are placed by the next pass, which follows at once.
        if out.placed >= config.max_placements_per_pass:
            return
        allowed = (
            [p for p in m.profiles if tree.within_limit(m.owner, usage, p.need())]
            if tree.limited
            else m.profiles
        )
        if not allowed:
            why = {
                p.name: f"owner {m.owner} would pass its limit with {_gpus(p.need().gpus)} more"
                for p in m.profiles
            }
            names = tuple([p.name for p in m.profiles])
            at = live + slot
            _fail(
                out,
                mk,
                m,
                "quota_limit",
                names,
                why,
                at,
                desired,
                avoided,
                functools.partial(
                    _quota_digest, m, names, avoided, at, desired, why, usage, tree, pass_.memo
                ),
                parent,
                now,
                failures,
                config,
            )
            return
        key = (pick.version, avoid, live + slot, desired)
        memo = pass_.memo
        known = None if blocked or pin is not None else memo.no_fits.get(m.name)
        if (
            known is None
            or known.key != key
            or known.model is not m
            or (known.allowed is not allowed and known.allowed != allowed)
        ):
            if pin is not None:
                found = placement.place(pick, allowed, avoid, domain=pin.domain)
            else:
                found = _place(pick, allowed, avoid, memo)
            if isinstance(found, placement.Placement):
                taken = _take(pass_, m, found, pick, usage, slot, avoided, pin)
                if taken is None:
                    return  # Invariant: place() only offers what the inventory can take.
                pick = taken
                pin = None
                continue
            why = _why_no_fit(m, allowed, found.reasons, blocked)
            known = _NoFit(m, key, allowed, tuple([p.name for p in allowed]), why)
            if not blocked and pin is None:
                if len(memo.no_fits) >= NO_FITS_MAX:
                    memo.no_fits.clear()
                memo.no_fits[m.name] = known
        _fail(
            out,
            mk,
            m,
            "no_fit",
            known.names,
            known.why,
            live + slot,
            desired,
            avoided,
            known.digest_with(avoided, pick, memo),
            parent,
            now,
            failures,
            config,
        )
        return
    out.satisfied.append(m.name)


def _why_no_fit(
    m: catalog.Model,
    allowed: Sequence[catalog.Profile],
    reasons: Iterable[tuple[str, str]],
    blocked: Mapping[str, Backoff],
) -> dict[str, str]:
    """Per profile of `m`, why its next replica has no place: placement's `reasons` for
    the `allowed` profiles, the owner's limit for the others, each with the backoffs that
    kept it off nodes (`blocked`)."""
    why = dict(reasons)
    if allowed is not m.profiles:
        for p in m.profiles:
            if p not in allowed:
                why[p.name] = f"owner {m.owner} would pass its limit"
    if blocked:
        notes = "; ".join(blocked[n].note() for n in sorted(blocked))
        why = {k: f"{v} ({notes})" for k, v in why.items()}
    return why


def _take(
    pass_: _Pass,
    m: catalog.Model,
    found: placement.Placement,
    pick: inventory.Inventory,
    usage: dict[str, quota.Amount],
    slot: int,
    avoided: tuple[str, ...],
    pin: Preempting | None = None,
) -> inventory.Inventory | None:
    """Take a placement `found` on `pick`: allocate it in the pass's inventory (and in
    `pick` when that is a copy of its own), count it in the owner's usage, and add the
    placement.decided and its replica.start commands. The pick to go on with; None, and
    nothing taken, when the inventory refuses it."""
    out, mk = pass_.out, pass_.mk
    shared = pick is pass_.inv
    inv = pass_.own()
    if shared:
        pick = inv
    # A derived id keeps its parent's time: the token's, for the placement and its starts.
    token, ms = pass_.parent()
    pid = ids.derived(token, f"place\x00{m.name}\x00{slot}", ms)
    rid = replica_id(m.name, pid)
    p = found.profile
    alloc = inventory.Allocation(
        replica=rid, shards=found.shards, cpu_cores=p.cpu_cores, memory_gb=p.memory_gb
    )
    if inv.try_allocate(alloc) is not None:
        return None
    if pick is not inv:
        pick.allocate(alloc)
    need = p.need()
    tree = pass_.view.quota
    for q in _chain(tree, m):
        usage[q] = usage.get(q, quota.ZERO).plus(need)
    shards = tuple(ev.ShardSpec(node=s.node, gpus=s.gpus) for s in found.shards)
    reason = _reason(m, p, found.shards, inv, avoided)
    if pin is not None:
        reason += f"; pinned to {pin.domain}, the room preemption {pin.decision} freed"
    decided = ev.PlacementDecided(
        replica=rid, model=m.name, profile=p.name, shards=shards, reason=reason
    )
    out.outputs.append(Output(mk(decided, pid)))
    start = ev.ReplicaStart(replica=rid, model=m.name, profile=p.name, shards=shards)
    for s in found.shards:
        sid = ids.derived(pid, f"start\x00{s.node}", ms)
        out.outputs.append(Output(mk(start, sid, causation=pid), node=s.node))
    out.placed += 1
    return pick


class Memo:
    """What a scheduler keeps from one pass to the next, owned by its caller (the
    scheduler service's leader, the simulator's engine): `plan` without one keeps
    nothing past the pass. Every entry is checked against what it was worked out from
    before it is used, so a pass decides the same with or without it
    (tests/core/test_scheduling_repeat.py). It buys the passes of a full cluster that
    report the same failing models again and again (bench_scheduler).

    misses: placements that found nothing, by the inventory's version, the profiles and
    the avoided nodes. Models of one profile fail one after another on an inventory that
    did not change in between, and passes with nothing placed between them see the same
    inventory again: what did not fit then does not fit now, for the very same reasons.

    no_fits: per model name, its last placement that found nothing (see `_NoFit`).

    digests: the prints of the cluster last hashed, the latest first, each with each
    failure's digest by what the failure was decided on, as [print, digests]. A model
    that still does not fit is decided on the same again, pass after pass, and hashing
    the print of a large cluster costs more than finding it here. Found by the print
    itself (compared whole), so the digest is the one hashing would give.

    rows: the last print's node names, the usage of each and its row of the print, in
    the same order. A usage is replaced, never changed, so its row never changes, and
    the list keeps each usage it names alive, so that no other object can be taken for
    it: only the rows of the nodes that changed are encoded again.

    last_print: the inventory version last printed and its print."""

    __slots__ = ("digests", "last_print", "misses", "no_fits", "rows")

    def __init__(self) -> None:
        self.misses: dict[
            tuple[object, tuple[catalog.Profile, ...], tuple[str, ...]], placement.NoFit
        ] = {}
        self.no_fits: dict[str, _NoFit] = {}
        self.digests: list[list[Any]] = []
        self.rows: list[Any] = [(), [], []]
        self.last_print: list[Any] = [None, b""]


# MISSES_MAX bounds `Memo.misses`, NO_FITS_MAX `Memo.no_fits` (one per model of the
# catalog, cleared in the unlikely case it holds more).
MISSES_MAX = 4096
NO_FITS_MAX = 4096


def _place(
    inv: inventory.Inventory,
    profiles: Sequence[catalog.Profile],
    avoid: tuple[str, ...],
    memo: Memo,
) -> placement.Placement | placement.NoFit:
    """`placement.place`, remembering what found nothing for as long as it holds."""
    key = (inv.version, tuple(profiles), avoid)
    miss = memo.misses.get(key)
    if miss is not None:
        return miss
    found = placement.place(inv, profiles, avoid)
    if isinstance(found, placement.NoFit):
        if len(memo.misses) >= MISSES_MAX:
            memo.misses.clear()
        memo.misses[key] = found
    return found


def _chain(tree: quota.QuotaTree, m: catalog.Model) -> list[str]:
    """The quotas whose usage a replica of the model counts towards, nearest first."""
    return [q.name for q in tree.governing(m.owner)]


def _reason(
    m: catalog.Model,
    p: catalog.Profile,
    shards: tuple[inventory.Shard, ...],
    inv: inventory.Inventory,
    avoid: tuple[str, ...],
) -> str:
    if len(shards) == 1:
        node = shards[0].node
        text = f"best fit: {p.name} on {node}, {_gpus(len(inv.free_gpus(node)))} left"
    else:
        # A gang: what each of its nodes has left, named, so two counts read as two nodes.
        where = "+".join(s.node for s in shards)
        left = ", ".join(f"{s.node} {len(inv.free_gpus(s.node))}" for s in shards)
        text = f"best fit: {p.name} on {where} ({len(shards)} shards; GPUs left: {left})"
    earlier = [q.name for q in m.profiles[: m.profiles.index(p)]]
    if earlier:
        text += f" ({', '.join(earlier)} did not fit)"
    if avoid and not set(avoid) & {s.node for s in shards}:
        text += f"; avoiding {', '.join(avoid)}"
    return text


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _fail(
    out: Plan,
    mk: _Maker,
    m: catalog.Model,
    reason: str,
    names: tuple[str, ...],
    why: dict[str, str],
    live: int,
    desired: int,
    avoid: tuple[str, ...],
    digest_of: Callable[[], str],
    parent: Callable[[], tuple[str, int]],
    now: datetime,
    failures: Mapping[str, Failure],
    config: Config,
) -> None:
    """Report a model that cannot be placed: once per change in what it was decided on
    (`digest_of`, see `_failure_digest`), at most once per quiet period; unchanged, again
    after a period that doubles each time up to its cap. Never once per pass. `parent`:
    the parent of the id and its time (see `_Pass.parent`), asked for only to report."""
    last = failures.get(m.name)
    since = 0.0 if last is None else (now - last.at).total_seconds()
    if last is not None and since < config.failed_quiet_s:
        return  # said too lately: what it was decided on is not even looked at
    digest = digest_of()
    repeats = 0
    if last is not None and last.digest == digest:
        r = last.repeats
        if since < failed_period_s(r, config):
            return
        repeats = last.repeats + 1
    data = ev.PlacementFailed(
        model=m.name,
        profiles=names,
        avoid=avoid,
        live=live,
        desired=desired,
        reason=reason,
        why=dict(why),
    )
    token, ms = parent()
    fid = ids.derived(token, f"failed\x00{m.name}", ms)
    out.outputs.append(Output(mk(data, fid), failure=(m.name, Failure(digest, now, repeats))))
    out.failed += 1


def _failure_digest(
    reason: str,
    model: str,
    names: tuple[str, ...],
    avoid: tuple[str, ...],
    live: int,
    desired: int,
    why: Mapping[str, str],
    printed: bytes,
    memo: Memo,
) -> str:
    """The digest of what a failure was decided on and of the print of the cluster (or
    of the owner's usage) it was decided with."""
    decided = _encoder.encode([reason, model, names, avoid, live, desired, sorted(why.items())])
    memos = memo.digests
    for i, kept in enumerate(memos):
        if kept[0] is printed or kept[0] == printed:
            if i:
                memos.insert(0, memos.pop(i))
            by: dict[bytes, str] = kept[1]
            break
    else:
        by = {}
        memos.insert(0, [printed, by])
        del memos[DIGESTS_PRINTS:]
    if len(by) >= DIGESTS_MAX:
        by.clear()
    digest = by.get(decided)
    if digest is None:
        # The hash of decided + printed, fed in two parts rather than joined first.
        h = hashlib.blake2b(decided, digest_size=16)
        h.update(printed)
        digest = by[decided] = h.hexdigest()
    return digest


class _NoFit:
    """A model's placement that found nothing, as its failure is reported: the inputs it was decided on (`key`: the version of the inventory placement chose from, the nodes
    it avoided, the live and desired counts; the model, the profiles allowed), the
    profiles' names, the reasons per profile, and the failure's digest once made.

    What `_place_missing` keeps of the last one per model (`Memo.no_fits`), for models with
    no node they back off from (those choose from a copy of their own, a new version
    each pass). On the same inputs, placement finds nothing again for the same reasons
    (see `Memo.misses`), and the print of the cluster is that of the same version: the
    names, the reasons and the digest come out the same, and a model that keeps failing
    on an unchanged cluster is not placed, explained and hashed again on every pass."""

    __slots__ = ("allowed", "digest", "key", "model", "names", "why")

    def __init__(
        self,
        model: catalog.Model,
        key: tuple[object, tuple[str, ...], int, int],
        allowed: Sequence[catalog.Profile],
        names: tuple[str, ...],
        why: dict[str, str],
    ) -> None:
        self.model = model
        self.key = key
        self.allowed = allowed
        self.names = names
        self.why = why
        self.digest: str | None = None

    def digest_with(
        self, avoided: tuple[str, ...], inv: inventory.Inventory, memo: Memo
    ) -> Callable[[], str]:
        """How `_fail` gets the digest of this failure avoiding `avoided`, with the print
        of the cluster `inv` (`_inventory_print`): made once, when first asked for."""
        if self.digest is not None:
            return self._made

        def digest() -> str:
            got = self.digest
            if got is None:
                _, _, live, desired = self.key
                got = _failure_digest(
                    "no_fit",
                    self.model.name,
                    self.names,
                    avoided,
                    live,
                    desired,
                    self.why,
                    _inventory_print(inv, memo),
                    memo,
                )
                self.digest = got
            return got

        return digest

    def _made(self) -> str:
        assert self.digest is not None  # Invariant: only given out once made.
        return self.digest


def remember(
    failures: Mapping[str, Failure], satisfied: Iterable[str], now: datetime, config: Config
) -> dict[str, Failure]:
    """The failure memory after a pass: a model placed in full keeps only when it was last
    reported (its next failure is news, but waits out the quiet period), and what is older
    than any period it could still matter to is forgotten."""
    keep = 2 * max(config.failed_backoff_max_s, config.failed_quiet_s)
    # A failure's age in seconds only grows the earlier it was said: when the oldest is
    # kept, all are, and the memory is kept whole without working out each one's age.
    if failures and (now - min([f.at for f in failures.values()])).total_seconds() < keep:
        out = dict(failures)
    else:
        out = {m: f for m, f in failures.items() if (now - f.at).total_seconds() < keep}
    for m in satisfied:
        f = out.get(m)
        if f is not None and f.digest:
            out[m] = f.cleared()
    return out


def failed_period_s(repeats: int, config: Config) -> float:
    """How long an unchanged failure said `repeats` times again waits to be said again."""
    return min(config.failed_backoff_s * 2.0 ** min(repeats, 62), config.failed_backoff_max_s)


_encoder = msgspec.json.Encoder(order="sorted")

# DIGESTS_PRINTS bounds the prints `Memo.digests` keeps, DIGESTS_MAX the digests for one
# print: a cluster that stays the same while a failure's reasons keep changing (a
# backoff's "until" time) would add one every quiet period.
DIGESTS_PRINTS = 8
DIGESTS_MAX = 4096


def _inventory_print(inv: inventory.Inventory, memo: Memo) -> bytes:
    """What placement saw of the cluster: each node's free GPUs, CPU, memory and flags."""
    last = memo.last_print
    if inv.version == last[0]:
        return bytes(last[1])
    names = inv.names()
    usages = list(map(inv.usage, names))
    printed = _print_rows(names, usages, memo)
    last[0], last[1] = inv.version, printed
    return printed


def _print_rows(
    names: tuple[str, ...], usages: list[inventory.NodeUsage | None], memo: Memo
) -> bytes:
    """The JSON array of each node's row, the nodes in name order (`names`, with their
    `usages`): the rows are encoded one by one, and joined as the encoder joins the
    items of an array (with a comma, no space). A row of the last print is used again
    for the very same usage of the same node."""
    last = memo.rows
    if names is last[0] or names == last[0]:
        parts: list[bytes] = last[2].copy()
        changed = list(map(operator.is_not, usages, last[1]))
        i = -1
        while True:
            try:
                i = changed.index(True, i + 1)
            except ValueError:
                break
            parts[i] = _row(usages[i])
    else:
        parts = [_row(u) for u in usages]
    last[0], last[1], last[2] = names, usages, parts
    return b"[" + b",".join(parts) + b"]"


def _row(u: inventory.NodeUsage | None) -> bytes:
    assert u is not None  # Invariant: a print's names are its inventory's own.
    return _encoder.encode(
        (u.node.name, u.free, u.schedulable, round(u.free_cpu, 3), round(u.free_memory, 3))
    )


def _quota_digest(
    m: catalog.Model,
    names: tuple[str, ...],
    avoided: tuple[str, ...],
    live: int,
    desired: int,
    why: Mapping[str, str],
    usage: Mapping[str, quota.Amount],
    tree: quota.QuotaTree,
    memo: Memo,
) -> str:
    """The digest of a quota_limit failure of `m`, with what it saw: the usage of each
    quota governing it."""
    printed = _encoder.encode([(q, usage.get(q, quota.ZERO)) for q in _chain(tree, m)])
    return _failure_digest("quota_limit", m.name, names, avoided, live, desired, why, printed, memo)


def _drain(
    out: Plan,
    mk: _Maker,
    replica: str,
    model: str,
    cause: str | None,
    nodes: tuple[str, ...],
    reason: ev.DrainReason,
    config: Config,
) -> None:
    """A `replica.drain` on each of `nodes`, caused by `cause` (the replica's placement;
    for `shard_failed`, what failed its first shard).

    The id is derived from the cause, the replica and the reason only: whoever decides
    it, on whichever view, asks the same replica to stop for the same reason once.
    """
    parent = cause or _anchor(None, f"replica\x00{replica}")
    data = ev.ReplicaDrain(
        replica=replica, model=model, reason=reason, grace_s=config.drain_grace_s
    )
    if not nodes:
        return  # no node to send it to; a replica with no shards holds nothing
    for node in nodes:
        did = ids.derived(parent, f"drain\x00{replica}\x00{reason}\x00{node}")
        out.outputs.append(Output(mk(data, did, causation=cause), node=node))
    out.drained += 1


class _Maker:
    """Wraps data in an envelope stamped with the pass's time and source."""

    __slots__ = ("now", "source")

    def __init__(self, now: datetime, source: str) -> None:
        self.now = now
        self.source = source

    def __call__(self, data: ev.Data, eid: str, causation: str | None = None) -> ev.Event:
        return ev.make(data, id=eid, time=self.now, source=self.source, causation=causation)
