"""The fold: `view = fold(view, event)`, the one function every view is built with.

Used by the projector (then persisted to SQLite), by the scheduler and the preemption
service (in memory), and by replay. Deterministic: the same events in the same order
give the same view, on any machine. No wall clock: time comes from the events.

For speed the fold changes the view in place and returns it; a caller that needs the
view as it was takes `view.copy()` (or a snapshot) first. A fold of a million events
has about three microseconds for each, which leaves no room for copying the view.

An event that breaks an invariant (a replica's state going backwards, an agent
reporting a replica on a node that is not its own or one no placement made, an
endpoint off its node's address, a drain for an unknown replica) is not applied: `apply` returns a `Rejection` saying why, and counts it in the view. The
fold never raises on input, so one bad event can never stop a consumer.

`RULES` is the one table of event types: for each, its handler, what an applied event
changed (`Touched`: the rows a store rewrites) and which entities it is about (what
history filters on). Readers of the log do not call the fold directly but through
`services.core.ingest`, which decodes and checks a raw message first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import msgspec

from schemas import events as ev
from schemas import names
from services.core.inventory import shortfall
from services.core.view import (
    RECENT_DECISIONS,
    RECENT_REJECTIONS,
    DecisionRecord,
    DemandRecord,
    HoldRecord,
    NodeRecord,
    PolicyRecord,
    Preempting,
    Rejection,
    ReplicaRecord,
    ScaleRecord,
    View,
    after,
    allocate,
    model_of,
    node_of,
    profile_of,
    quota_tree_of,
)

_ORDER = ev.STATE_ORDER
NEVER_PLACED = "was never placed"
"""What the rejection of a report about a replica no placement put there says; such a
report is also dead-lettered (`ingest`)."""
_HOLDING = ev.HOLDING_STATES


def apply(
    view: View, event: ev.Envelope, *, seq: int = 0, subject: str | None = None
) -> Rejection | None:
    """Fold one event into the view; returns why it was rejected, or None when applied.

    `seq` is the event's stream sequence (0 when unknown, as in tests); `subject` the
    subject it arrived on, which replica reports are checked against (None: unchecked).
    """
    return apply_rule(view, RULES.get(type(event)), event, seq, subject)


def apply_rule(
    view: View, rule: Rule | None, event: ev.Envelope, seq: int, subject: str | None
) -> Rejection | None:
    """`apply` with the event's rule already looked up (`RULES`): what ingest calls, so
    the table is read once per event."""
    s = view.state
    view.folds += 1
    # The sequence moves first: a decision recorded by the handler carries its own
    # sequence, not the one before it.
    if seq:
        s.seq = seq
    why = "unknown event type" if rule is None else rule.fold(view, event, subject)
    t = event.time
    if s.time is None or t > s.time:
        s.time = t
    if why is None:
        return None
    rej = Rejection(seq=seq, id=event.id, type=ev.type_of(type(event)), reason=why)
    s.rejected += 1
    s.rejections.append(rej)
    if len(s.rejections) > 2 * RECENT_REJECTIONS:
        del s.rejections[:-RECENT_REJECTIONS]
    return rej


def fold(view: View, event: ev.Envelope, *, seq: int = 0, subject: str | None = None) -> View:
    """`apply`, returning the view (the rejection, if any, is recorded in it)."""
    apply(view, event, seq=seq, subject=subject)
    return view


# ---------------------------------------------------------------- catalog


def _model_declared(view: View, e: ev.ModelDeclaredEvent, subject: str | None) -> str | None:
    d = e.data
    if not d.profiles:
        return f"model {d.name} declares no profiles"
    view.state.models[d.name] = d
    view.catalog.put(model_of(d))
    return None


def _model_removed(view: View, e: ev.ModelRemovedEvent, subject: str | None) -> str | None:
    name = e.data.name
    if view.state.models.pop(name, None) is None:
        return f"model {name} is not declared"
    view.catalog.remove(name)
    return None


def _quota_set(view: View, e: ev.QuotaSetEvent, subject: str | None) -> str | None:
    tree = quota_tree_of(e.data.owners)
    if tree.errors:
        return "quota tree: " + "; ".join(tree.errors)
    view.state.quota = e.data.owners
    view.quota = tree
    return None


def _scale_desired(view: View, e: ev.ScaleDesiredEvent, subject: str | None) -> str | None:
    d = e.data
    m = view.catalog.resolve(d.model)
    name = m.name if m is not None else d.model
    s = view.state
    s.desired[name] = d.replicas
    s.scaled[name] = ScaleRecord(
        replicas=d.replicas, at=e.time, id=e.id, source=e.source, reason=d.reason
    )
    dem = s.demand.get(name)
    if dem is not None and dem.answered_by is None:
        s.demand[name] = msgspec.structs.replace(dem, answered_by=e.id)
    if d.reason is not None:
        _decided(view, e, name, "scaled", f"{d.replicas} desired: {d.reason}")
    return None


def _model_demanded(view: View, e: ev.ModelDemandedEvent, subject: str | None) -> str | None:
    d = e.data
    m = view.catalog.resolve(d.model)
    name = m.name if m is not None else d.model
    # The latest wins by the event's time: a report delayed behind a newer one does not
    # bring back a count the gateway has moved past.
    old = view.state.demand.get(name)
    if old is not None and e.time < old.at:
        return None
    # `since` is a claimed time: bounded by the event's (see `_replica_used`).
    since = d.since if d.since <= e.time else e.time
    view.state.demand[name] = DemandRecord(
        waiting=d.waiting, since=since, at=e.time, inflight=d.inflight, id=e.id
    )
    return None


# ---------------------------------------------------------------- nodes


def _node_inventory(view: View, e: ev.NodeInventoryEvent, subject: str | None) -> str | None:
    d = e.data
    if subject is not None and (why := _subject_node_mismatch(subject, d.node)):
        return why
    if len({g.index for g in d.gpus}) != len(d.gpus):
        return f"node {d.node} reports a GPU index twice"
    old = view.state.nodes.get(d.node)
    if old is not None and not old.lost and old.report == d:
        # The same report again: nothing the inventory knows has changed.
        old.updated_at = e.time
        return None
    # A fresh report means the agent is back: a lost node is found again. A cordon is an
    # operator's decision and outlives reports.
    rec = NodeRecord(
        report=d, cordoned=old.cordoned if old else False, lost=False, updated_at=e.time
    )
    view.state.nodes[d.node] = rec
    view.inventory.set_node(node_of(rec))
    view.note_node(rec)
    # A report is the node's whole inventory: a replica whose GPUs it no longer has (or
    # has as another model, or smaller than its profile asks) cannot be running there,
    # and what it held is not there to hold. It fails, so GPUs in use never exceed GPUs
    # present.
    for rid, why in _uncovered(view, d):
        r = view.state.replicas[rid]
        _fail(view, r, f"node {d.node} no longer has its GPUs: {why}", e, d.node)
    return None


def _uncovered(view: View, d: ev.NodeInventory) -> list[tuple[str, str]]:
    """The replicas holding GPUs on node `d.node` that its report `d` no longer covers,
    with why (`inventory.shortfall`), in id order."""
    held = view.inventory.replicas_on(d.node)
    if not held:
        return []
    gpus = {g.index: g for g in d.gpus}
    reps = view.state.replicas
    out = []
    for rid in held:
        r = reps.get(rid)
        if r is None:
            continue
        p = profile_of(view, r)
        mine = [i for sh in r.shards if sh.node == d.node for i in sh.gpus]
        why = (
            shortfall(gpus, mine)
            if p is None
            else shortfall(gpus, mine, p.gpu_model, p.gpu_memory_gb)
        )
        if why is not None:
            out.append((rid, why))
    return out


def _fail(view: View, r: ReplicaRecord, reason: str, e: ev.Envelope, node: str) -> None:
    """The failure of a replica's shard on `node` (its node lost, its GPUs gone, its
    agent said so): capacity there released, and a report from it later is a state
    going backwards.

    A replica with shards on other nodes still running (a gang) cannot serve without
    this one, but their servers still hold their GPUs: it is draining, their GPUs stay
    held until their agents say `stopped` (the scheduler asks them to:
    `ReplicaRecord.failed_on`), and the last one leaves it failed. Freed at once, the
    next start on those GPUs would find them taken by the orphaned shard's server."""
    if len(r.shards) > 1:
        if node not in r.failed_on:
            r.failed_on += (node,)
        if r.failed_by is None:
            r.failed_by = e.id
        gone = r.stopped_on + r.failed_on
        if any(n not in gone for n in r.nodes):
            r.reason, r.updated_at = reason, e.time
            if r.state != "draining":
                r.state = "draining"
            view.inventory.release_node(r.id, node)
            view.note(r)
            return
    r.state, r.reason, r.updated_at = "failed", reason, e.time
    view.inventory.release_replica(r.id)
    view.note(r)


def _node_lost(view: View, e: ev.NodeLostEvent, subject: str | None) -> str | None:
    d = e.data
    rec = view.state.nodes.get(d.node)
    if rec is None:
        return f"unknown node {d.node}"
    if d.grace_s > 0:
        # Lost with a grace: no new placement, but its replicas keep their state and
        # their GPUs, for its agent may still be serving them. The grace runs from the
        # first word of the loss; a second such word does not stretch it.
        if not rec.lost:
            rec.failing_at = after(e.time, d.grace_s)
        rec.lost, rec.lost_reason, rec.updated_at = True, d.reason, e.time
        view.inventory.set_lost(rec.report.node, True)
        view.note_node(rec)
        return None
    rec.lost, rec.lost_reason, rec.updated_at, rec.failing_at = True, d.reason, e.time, None
    view.inventory.set_lost(rec.report.node, True)
    view.note_node(rec)
    # A lost node's replicas are gone with it: their capacity there is released, and a
    # report from them later is a state going backwards, not a resurrection. A gang's
    # shards on the nodes still alive hold theirs until they stop (`_fail`).
    # Invariant: every replica holding capacity on a node has its allocation there, so
    # the inventory's index finds them without scanning every replica of the cluster.
    reps = view.state.replicas
    for rid in view.inventory.replicas_on(rec.report.node):
        _fail(view, reps[rid], f"node lost: {d.reason}", e, d.node)
    return None


def _node_found(view: View, e: ev.NodeFoundEvent, subject: str | None) -> str | None:
    rec = view.state.nodes.get(e.data.node)
    if rec is None:
        return f"unknown node {e.data.node}"
    if not rec.lost:
        return None  # back already: its report came first
    # Heard from again: it takes placements again, and what its replicas still hold
    # (within the grace) they keep. Those already failed stay failed.
    rec.lost, rec.lost_reason, rec.failing_at, rec.updated_at = False, None, None, e.time
    view.inventory.set_lost(rec.report.node, False)
    view.note_node(rec)
    return None


def _node_cordon(
    view: View, e: ev.NodeCordonedEvent | ev.NodeUncordonedEvent, subject: str | None
) -> str | None:
    rec = view.state.nodes.get(e.data.node)
    if rec is None:
        return f"unknown node {e.data.node}"
    rec.cordoned = isinstance(e, ev.NodeCordonedEvent)
    rec.updated_at = e.time
    view.inventory.set_cordoned(rec.report.node, rec.cordoned)
    return None


def _node_removed(view: View, e: ev.NodeRemovedEvent, subject: str | None) -> str | None:
    d = e.data
    rec = view.state.nodes.get(d.node)
    if rec is None:
        return f"unknown node {d.node}"
    # What still holds GPUs there fails with it (`llmgw delete node` drains them first,
    # or, with --force, removes a node that cannot answer any more).
    reps = view.state.replicas
    why = f"node removed: {d.reason}" if d.reason else "node removed"
    for rid in view.inventory.replicas_on(d.node):
        _fail(view, reps[rid], why, e, d.node)
    rec.failing_at = None
    view.note_node(rec)
    del view.state.nodes[d.node]
    view.inventory.remove_node(d.node)
    return None


# ---------------------------------------------------------------- replicas


def _replica_state(view: View, e: ev.ReplicaStateEvent, subject: str | None) -> str | None:
    d = e.data
    r = view.state.replicas.get(d.replica)
    if r is None:
        # Only what the plane placed exists (as a kubelet creates no pod): an agent
        # reports the replicas a placement put on its node, and creates none. A report
        # for one never placed would count as the model's capacity, and be routed to.
        node = _subject_node(subject) if subject is not None else None
        return f"replica {d.replica} {NEVER_PLACED} on {node or d.node or 'any node'}"
    shards = _placed_shards(r, d)
    if isinstance(shards, str):
        return shards
    why = _not_its_to_say(view, r, d, shards, subject)
    if why is not None:
        return why
    whole = _of_the_whole(view, r, d, e)
    if whole is None:
        return None
    return _replica_moves(view, r, whole, shards, e)


def _placed_shards(r: ReplicaRecord, d: ev.ReplicaState) -> tuple[ev.ShardSpec, ...] | str:
    """The shards a report about `r` speaks of, or why it cannot. Once a replica has a
    placement, its shards are the placement's, not what a report claims: otherwise an
    agent could "move" another node's replica to itself as stopped and free that node's
    GPUs for the scheduler to fill again, in a loop."""
    if not r.shards:
        return d.shards
    if d.shards and d.shards != r.shards:
        return (
            f"replica {d.replica} is placed on {_where_gpus(r.shards)}, not {_where_gpus(d.shards)}"
        )
    return r.shards


def _not_its_to_say(
    view: View,
    r: ReplicaRecord,
    d: ev.ReplicaState,
    shards: tuple[ev.ShardSpec, ...],
    subject: str | None,
) -> str | None:
    """Authority: why the report `d` about `r` (on `shards`) is not its sender's to
    make, or None. An agent speaks only for replicas recorded on its own node, of the
    model they are of."""
    if subject is not None and shards:
        node = _subject_node(subject)
        if node is not None and not _has_node(shards, node):
            return f"agent on {node} reports replica {d.replica}, which has no shard there"
    if d.node is not None and (why := _not_its_shard(d, shards, subject)):
        return why
    if d.endpoint is not None and (why := _foreign_endpoint(view, d, d.endpoint, shards, subject)):
        return why
    if r.model != d.model:
        return f"replica {d.replica} is of model {r.model}, not {d.model}"
    return None


def _of_the_whole(
    view: View, r: ReplicaRecord, d: ev.ReplicaState, e: ev.ReplicaStateEvent
) -> ev.ReplicaState | None:
    """What the report `d` says of the whole replica `r` (a gang's shard speaks for
    itself first, `_shard_state`); None when it says nothing more, or all it says is
    recorded here."""
    if d.node is not None and r.state in _HOLDING:
        return _shard_state(view, r, d, e)
    if r.failed_on and d.node is not None:
        if d.state in ("stopped", "failed") and (d.node in r.stopped_on or d.node in r.failed_on):
            return None  # a failed gang's shard saying its last again
    elif r.failed_on and r.state in _HOLDING:
        # A report about the whole of a gang one of whose shards failed: it stops (and
        # then failed, as it did), or it says nothing that changes that.
        if d.state in _HOLDING:
            return None
        r.state, r.updated_at = "failed", e.time
        view.inventory.release_replica(r.id)
        view.note(r)
        return None
    return d


def _replica_moves(
    view: View,
    r: ReplicaRecord,
    d: ev.ReplicaState,
    shards: tuple[ev.ShardSpec, ...],
    e: ev.ReplicaStateEvent,
) -> str | None:
    """`r` moves to the state `d` says, on `shards`: forward only, its GPUs taken when it
    starts holding them (or holds others) and released when it stops; or why not."""
    before, after = _ORDER[r.state], _ORDER[d.state]
    if after < before or (after == before and d.state != r.state):
        return f"replica {d.replica} cannot go from {r.state} to {d.state}"
    if d.state in _HOLDING and shards and (shards != r.shards or r.state not in _HOLDING):
        r2 = ReplicaRecord(
            id=r.id,
            model=r.model,
            profile=d.profile,
            state=d.state,
            shards=shards,
            created_at=r.created_at,
            updated_at=e.time,
        )
        why = allocate(view, r2)
        if why is not None:
            return f"replica {d.replica}: {why}"
        r.cpu_cores, r.memory_gb = r2.cpu_cores, r2.memory_gb
    elif d.state not in _HOLDING:
        view.inventory.release_replica(r.id)
    if d.reason is not None or d.state != r.state:
        r.reason = d.reason
    r.state, r.profile, r.shards, r.updated_at = d.state, d.profile, shards, e.time
    if d.endpoint is not None:
        r.endpoint = d.endpoint
    first_ready = d.state == "ready" and r.ready_at is None
    if first_ready:
        r.ready_at = e.time
    view.note(r, ready=first_ready)
    return None


def _shard_state(
    view: View, r: ReplicaRecord, d: ev.ReplicaState, e: ev.ReplicaStateEvent
) -> ev.ReplicaState | None:
    """What a report about the shard on node `d.node` of `r` (holding capacity) says of
    the whole replica, once what it says of the shard is recorded; None when nothing
    more.

    A replica is what all its shards are: ready when the last says ready (until then
    loading, and its endpoint the head's, shard 0's, whose server takes the requests);
    stopped when the last says stopped (each one's GPUs free at its own); failed when
    one fails, and then what the others say changes nothing but their stop (`_fail`)."""
    node = d.node
    assert node is not None
    state = d.state
    if state == "stopped":
        if node in r.stopped_on or node in r.failed_on:
            return None  # that shard said its last already
        r.stopped_on += (node,)
        if any(n not in r.stopped_on and n not in r.failed_on for n in r.nodes):
            # One shard of several stopped: its GPUs are free, the others' still held,
            # and the replica keeps its state until the last shard stops.
            view.inventory.release_node(r.id, node)
            r.updated_at = e.time
            view.note(r)
            return None
        if r.failed_on:
            # The last shard of a gang one of whose shards failed: the gang failed.
            r.state, r.updated_at = "failed", e.time
            view.inventory.release_replica(r.id)
            view.note(r)
            return None
        return d
    if len(r.shards) < 2:
        return d
    if state == "failed":
        if node not in r.stopped_on and node not in r.failed_on:
            _fail(view, r, d.reason or f"its shard on {node} failed", e, node)
        return None
    if r.failed_on:
        return None  # a shard of a failed gang, on its way out: it stops, nothing else
    head = node == r.shards[0].node
    if state == "ready" and _ORDER[r.state] < _ORDER["ready"]:
        # (Said of a replica past ready, it is refused below and records nothing.)
        if node not in r.ready_on:
            r.ready_on += (node,)
        if any(n not in r.ready_on for n in r.nodes):
            # Ready here, not yet everywhere: the replica is loading still.
            return msgspec.structs.replace(
                d, state="loading", endpoint=d.endpoint if head else None
            )
    if not head and d.endpoint is not None:
        return msgspec.structs.replace(d, endpoint=None)
    return d


def _not_its_shard(
    d: ev.ReplicaState, shards: tuple[ev.ShardSpec, ...], subject: str | None
) -> str | None:
    """Why a report about the shard on node `d.node` cannot be: the replica has no shard
    there, or the report came from another node's agent."""
    assert d.node is not None
    got = _subject_node(subject) if subject is not None else None
    if got is not None and got != d.node:
        return f"agent on {got} reports the shard of replica {d.replica} on {d.node}"
    if shards and not _has_node(shards, d.node):
        return f"replica {d.replica} has no shard on {d.node}"
    return None


def endpoint_host(endpoint: str) -> str:
    """The host of an `http://host:port` endpoint, lower case, an IPv6 one unbracketed:
    what a node's `address` is compared with."""
    host = endpoint.partition("://")[2].rpartition(":")[0]
    return host.strip("[]").lower()


def on_address(endpoint: str, address: str) -> bool:
    """Whether `endpoint` is on a node whose recorded address is `address` ("": not
    said, so anywhere)."""
    return not address or endpoint_host(endpoint) == address.lower()


def _foreign_endpoint(
    view: View,
    d: ev.ReplicaState,
    endpoint: str,
    shards: tuple[ev.ShardSpec, ...],
    subject: str | None,
) -> str | None:
    """Why `endpoint` cannot be the replica's: it is not on the address the reporting
    node's inventory recorded (its agent's `--advertise`). The reporting node is the
    subject's; without one, the report's `node`, else any node of its shards."""
    node = _subject_node(subject) if subject is not None else None
    nodes = [node] if node is not None else [d.node] if d.node else [sh.node for sh in shards]
    recs = view.state.nodes
    said = []
    for n in nodes:
        rec = recs.get(n)
        address = rec.report.address if rec is not None else ""
        if on_address(endpoint, address):
            return None
        said.append(f"{n}'s address {address}")
    return f"replica {d.replica}'s endpoint {endpoint} is not on {' or '.join(said)}"


def used_at(e: ev.ReplicaUsedEvent) -> datetime:
    """When a `replica.used` says the replica last served, bounded by the event's time
    (which ingest bounds by when the log stored it): what the fold keeps, and what every
    reader of the event shows."""
    at = e.data.at
    return at if at <= e.time else e.time


def _replica_used(view: View, e: ev.ReplicaUsedEvent, subject: str | None) -> str | None:
    r = view.state.replicas.get(e.data.replica)
    if r is None:
        return f"unknown replica {e.data.replica}"
    if subject is not None and r.shards:
        node = _subject_node(subject)
        if node is not None and not _has_node(r.shards, node):
            return f"agent on {node} reports use of replica {r.id}, which has no shard there"
    # A claimed time is bounded by the event's, which ingest bounds by when the log
    # stored it: one report from the far future (or from a clock far ahead) cannot keep
    # the replica used for ever, and a replay bounds it alike. (`used_at`, written out:
    # this runs for most events of a serving cluster's log.)
    at = e.data.at
    if at > e.time:
        at = e.time
    if r.last_used_at is None or at > r.last_used_at:
        r.last_used_at = at
        view.note_use(r)
    # The latest in the log wins: one agent reads one server's metrics, in order.
    if e.data.engine is not None:
        r.engine = e.data.engine
    return None


# ---------------------------------------------------------------- decisions and commands


def _decided(view: View, e: ev.Envelope, model: str, outcome: str, summary: str) -> None:
    s = view.state
    s.decisions.append(
        DecisionRecord(
            seq=s.seq,
            id=e.id,
            time=e.time,
            type=ev.type_of(type(e)),
            model=model,
            outcome=outcome,
            summary=summary,
            causation=e.causation,
        )
    )
    if len(s.decisions) > 2 * RECENT_DECISIONS:
        del s.decisions[:-RECENT_DECISIONS]


def _placement_decided(view: View, e: ev.PlacementDecidedEvent, subject: str | None) -> str | None:
    d = e.data
    r = view.state.replicas.get(d.replica)
    shards = d.shards
    if r is not None:
        if r.placed_by == e.id or (r.shards == shards and r.model == d.model):
            return None  # the same decision again
        return f"replica {d.replica} already exists"
    r = ReplicaRecord(
        id=d.replica,
        model=d.model,
        profile=d.profile,
        state="pending",
        shards=shards,
        created_at=e.time,
        updated_at=e.time,
        placed_by=e.id,
        reason=d.reason,
    )
    why = allocate(view, r)
    if why is not None:
        return f"replica {d.replica}: {why}"
    view.state.replicas[d.replica] = r
    view.note(r)
    _end_pin(view, d.model)
    where = ", ".join(f"{s.node}[{','.join(map(str, s.gpus))}]" for s in shards)
    _decided(view, e, d.model, "placed", f"{d.replica} ({d.profile}) on {where}: {d.reason}")
    return None


def _placement_failed(view: View, e: ev.PlacementFailedEvent, subject: str | None) -> str | None:
    d = e.data
    why = "; ".join(f"{k}: {v}" for k, v in d.why.items()) or d.reason
    _decided(view, e, d.model, d.reason, f"live {d.live}/{d.desired}: {why}")
    return None


def _replica_start(view: View, e: ev.ReplicaStartEvent, subject: str | None) -> str | None:
    r = view.state.replicas.get(e.data.replica)
    if r is None:
        return f"start for replica {e.data.replica}, which was never placed"
    return _off_node_command(subject, r)


def _off_node_command(subject: str | None, r: ReplicaRecord) -> str | None:
    """Why a command on node X's command subject about replica `r` is not X's to carry
    out: `r` has no shard on X. The agent on X would never see a command meant for the
    replica's own node, and the first drain's reason would stand for a drain never done."""
    node = _command_node(subject) if subject is not None else None
    if node is not None and r.shards and not _has_node(r.shards, node):
        return f"command on {node}'s subject for replica {r.id}, which is on {_where(r.shards)}"
    return None


def _where(shards: tuple[ev.ShardSpec, ...]) -> str:
    return ",".join(sorted({sh.node for sh in shards})) or "no node"


def _where_gpus(shards: tuple[ev.ShardSpec, ...]) -> str:
    """`gpu-a2[0,1]`, each shard's node with its GPUs: two placements on one node differ
    by their GPUs alone."""
    return ", ".join(f"{sh.node}[{','.join(map(str, sh.gpus))}]" for sh in shards) or "no node"


def _replica_drain(view: View, e: ev.ReplicaDrainEvent, subject: str | None) -> str | None:
    d = e.data
    r = view.state.replicas.get(d.replica)
    if r is None:
        return f"drain for unknown replica {d.replica}"
    if why := _off_node_command(subject, r):
        return why
    node = _command_node(subject) if subject is not None else None
    if node is not None and node not in r.drained_on:
        r.drained_on += (node,)
    if r.drained_by is not None:
        return None  # already asked; the first reason stands
    r.drained_by, r.drain_reason = e.id, d.reason
    if d.reason == "scale_down":
        r.retiring_at = e.time
    elif d.reason == "preempted":
        r.preempted_for = d.for_model
    view.note(r)
    return None


def _preemption_decided(
    view: View, e: ev.PreemptionDecidedEvent, subject: str | None
) -> str | None:
    d = e.data
    if d.outcome == "preempted" and d.victims:
        view.state.preempting[d.for_model] = Preempting(
            for_model=d.for_model,
            victims=tuple(v.replica for v in d.victims),
            decision=e.id,
            at=e.time,
            domain=d.domain,
            until=pin_until(view, e) if d.domain else None,
        )
        summary = "stopping " + ", ".join(
            f"{v.replica} ({v.model}, tier {v.tier})" for v in d.victims
        )
    else:
        summary = d.reason or f"{d.considered} candidates considered"
    _decided(view, e, d.for_model, d.outcome, summary)
    return None


def pin_until(view: View, e: ev.PreemptionDecidedEvent) -> datetime:
    """When the hold of a decision ends, and the pin of its model's placement with it:
    read as `hold_until` reads a hold (the event's time plus the recorded hold, else
    the latest `until` the decision's holds claim; the event's time when it has none)."""
    p = view.state.policy
    if p is not None:
        return e.time + timedelta(seconds=p.settings.hold_s)
    return max((h.until for h in e.data.holds), default=e.time)


def _end_pin(view: View, model: str) -> None:
    """A replica of `model` was placed: the pin of its placement ends."""
    m = view.catalog.resolve(model)
    name = m.name if m is not None else model
    p = view.state.preempting.get(name)
    if p is not None and p.domain:
        view.state.preempting[name] = msgspec.structs.replace(p, domain="", until=None)


def _hold_created(view: View, e: ev.HoldCreatedEvent, subject: str | None) -> str | None:
    d = e.data
    view.state.holds[d.model] = HoldRecord(
        model=d.model,
        for_model=d.for_model,
        until=hold_until(view, e),
        created_at=e.time,
        created_by=e.id,
    )
    return None


def hold_until(view: View, e: ev.HoldCreatedEvent) -> datetime:
    """When a hold ends: its event's time (bounded by ingest against the broker's clock)
    plus the hold the log's `policy.configured` records, whatever `until` it claims.

    The policy computes `until` from the same clock as the event's time, so an honest
    host gets what it claimed; a host whose clock was an hour fast claimed an hour too,
    and the bound on event times cut only the time, not the `until`. Without a recorded
    policy (a log older than `policy.configured`) the claim stands, as it always did."""
    p = view.state.policy
    if p is None:
        return e.data.until
    return e.time + timedelta(seconds=p.settings.hold_s)


def _hold_released(view: View, e: ev.HoldReleasedEvent, subject: str | None) -> str | None:
    view.state.holds.pop(e.data.model, None)
    return None


def _policy_configured(view: View, e: ev.PolicyConfiguredEvent, subject: str | None) -> str | None:
    # The latest wins: a later leader's settings replace an earlier one's.
    s = view.state
    s.policy = PolicyRecord(settings=e.data, seq=s.seq, id=e.id, time=e.time, source=e.source)
    return None


def _ignored(view: View, e: ev.Envelope, subject: str | None) -> str | None:
    return None


# ---------------------------------------------------------------- subjects


def _has_node(shards: tuple[ev.ShardSpec, ...], node: str) -> bool:
    # A loop, not any(): this runs on every replica report, and a generator costs more
    # than the usual single shard's comparison.
    for sh in shards:  # noqa: SIM110
        if sh.node == node:
            return True
    return False


def _subject_node(subject: str) -> str | None:
    """The node token of a `<root>.node.<node>....` subject, unescaped."""
    parts = subject.split(".", 3)
    if len(parts) < 3 or parts[1] != "node":
        node = None
    elif "~" not in parts[2]:
        node = parts[2]
    else:
        try:
            node = names.unescape(parts[2])
        except names.TokenError:
            node = None
    return node


def _command_node(subject: str) -> str | None:
    """The node token of a `<root>.cmd.<node>....` subject, unescaped."""
    parts = subject.split(".", 3)
    if len(parts) < 3 or parts[1] != "cmd":
        return None
    try:
        return names.unescape(parts[2])
    except names.TokenError:
        return None


def _subject_node_mismatch(subject: str, node: str) -> str | None:
    got = _subject_node(subject)
    if got is not None and got != node:
        return f"agent on {got} reports the inventory of node {node}"
    return None


# ---------------------------------------------------------------- the table


@dataclass(frozen=True, slots=True)
class Dead:
    """A message that never reached the fold: its bytes did not decode, or its event does
    not belong on its subject. The projector dead-letters it; every reader skips it.
    (Also a report the fold rejected for a replica never placed: `ingest`.)"""

    seq: int
    subject: str
    reason: str
    data: bytes


@dataclass(slots=True)
class Touched:
    """What a run of events changed: the keys whose rows a store rewrites (or deletes,
    when gone from the view), and every decision, rejection and dead letter it added."""

    nodes: set[str] = field(default_factory=set)
    replicas: set[str] = field(default_factory=set)
    models: set[str] = field(default_factory=set)
    desired: set[str] = field(default_factory=set)
    """Models whose desired count (and its `scaled` record) changed."""
    demand: set[str] = field(default_factory=set)
    holds: set[str] = field(default_factory=set)
    preempting: set[str] = field(default_factory=set)
    quota: bool = False
    decisions: list[DecisionRecord] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    dead: list[Dead] = field(default_factory=list)
    count: int = 0
    """Messages in this run (dead letters included)."""

    def clear(self) -> None:
        self.nodes.clear()
        self.replicas.clear()
        self.models.clear()
        self.desired.clear()
        self.demand.clear()
        self.holds.clear()
        self.preempting.clear()
        self.quota = False
        self.decisions = []
        self.rejections = []
        self.dead = []
        self.count = 0


Key = tuple[str, str]
"""An entity: `(kind, name)`, kind one of `replica`, `model`, `node`, `quota`."""

_Handler = Callable[[View, Any, str | None], str | None]
_Before = Callable[[View, Any], Any]
_Touch = Callable[[View, Any, Touched, Any], None]
_About = Callable[[View, Any], Iterable[Key]]


@dataclass(frozen=True, slots=True)
class Rule:
    """What the fold does with one event type, and what it touches.

    `fold(view, event, subject)` applies it (None) or says why not; `touch(view, event,
    touched, before)` marks what an applied event changed, `before` being what
    `before(view, event)` read from the view ahead of the fold (what only the old view
    knows: a lost node's replicas). `about(view, event)`, with the view before the fold,
    names every entity the event is about, applied or not: what history filters on and
    a subscriber is told. `decision`: the fold records a decision for it.
    """

    fold: _Handler
    touch: _Touch
    about: _About
    before: _Before | None = None
    decision: bool = False


def _no_touch(view: View, e: Any, t: Touched, before: Any) -> None:
    return None


def _touch_model(view: View, e: Any, t: Touched, before: Any) -> None:
    t.models.add(e.data.name)


def _touch_quota(view: View, e: Any, t: Touched, before: Any) -> None:
    t.quota = True


def _touch_desired(view: View, e: ev.ScaleDesiredEvent, t: Touched, before: Any) -> None:
    m = view.catalog.resolve(e.data.model)
    name = m.name if m is not None else e.data.model
    t.desired.add(name)
    if name in view.state.demand:
        t.demand.add(name)


def _touch_demand(view: View, e: ev.ModelDemandedEvent, t: Touched, before: Any) -> None:
    m = view.catalog.resolve(e.data.model)
    t.demand.add(m.name if m is not None else e.data.model)


def _touch_node(view: View, e: Any, t: Touched, before: Any) -> None:
    t.nodes.add(e.data.node)


def _before_held(
    view: View, e: ev.NodeLostEvent | ev.NodeInventoryEvent | ev.NodeRemovedEvent
) -> tuple[str, ...]:
    # Invariant: a replica holding capacity on a node is allocated there, so the
    # inventory names every replica a loss or a new report can fail.
    return view.inventory.replicas_on(e.data.node)


def _touch_held(
    view: View,
    e: ev.NodeLostEvent | ev.NodeInventoryEvent | ev.NodeRemovedEvent,
    t: Touched,
    hit: tuple[str, ...],
) -> None:
    """The node, and the replicas it held that the event failed (with their nodes): all
    of a one-node replica, the shard there of a gang whose others still hold theirs."""
    node = e.data.node
    t.nodes.add(node)
    reps = view.state.replicas
    for rid in hit:
        r = reps.get(rid)
        if r is not None and (not r.holds_capacity or node in r.failed_on):
            t.replicas.add(rid)
            t.nodes.update(s.node for s in r.shards)


def _touch_replica(view: View, e: Any, t: Touched, before: Any) -> None:
    t.replicas.add(e.data.replica)


_Held = tuple[str, tuple[ev.ShardSpec, ...], tuple[str, ...]]
"""A replica's state, shards and `stopped_on` before an event: what its GPUs' rows show."""


def _before_allocation(view: View, e: Any) -> _Held | None:
    old = view.state.replicas.get(e.data.replica)
    return (old.state, old.shards, old.stopped_on) if old is not None else None


def _touch_allocation(view: View, e: Any, t: Touched, before: _Held | None) -> None:
    rid = e.data.replica
    t.replicas.add(rid)
    new = view.state.replicas[rid]
    # GPU rows show who holds each GPU: a node's rows change only when an allocation on
    # it may have changed (a shard of several stopping changes its node's).
    if (
        before is None
        or before[1] != new.shards
        or before[0] != new.state
        or before[2] != new.stopped_on
    ):
        if before is not None:
            t.nodes.update(s.node for s in before[1])
        t.nodes.update(s.node for s in new.shards)


def _touch_placed(
    view: View, e: ev.PlacementDecidedEvent, t: Touched, before: _Held | None
) -> None:
    """`_touch_allocation`, and the model's preemption entry, whose pin a placement ends."""
    _touch_allocation(view, e, t, before)
    m = view.catalog.resolve(e.data.model)
    name = m.name if m is not None else e.data.model
    if name in view.state.preempting:
        t.preempting.add(name)


def _touch_hold(view: View, e: Any, t: Touched, before: Any) -> None:
    t.holds.add(e.data.model)


def _touch_preempting(view: View, e: ev.PreemptionDecidedEvent, t: Touched, before: Any) -> None:
    t.preempting.add(e.data.for_model)


def _about_nothing(view: View, e: Any) -> tuple[Key, ...]:
    return ()


def _about_model(view: View, e: Any) -> tuple[Key, ...]:
    return (("model", e.data.name),)


def _about_quota(view: View, e: Any) -> tuple[Key, ...]:
    return (("quota", ""),)


def _about_node(view: View, e: Any) -> tuple[Key, ...]:
    return (("node", e.data.node),)


def _about_inventory(view: View, e: ev.NodeInventoryEvent) -> list[Key]:
    out: list[Key] = [("node", e.data.node)]
    # The replicas the report no longer covers: the fold fails them.
    reps = view.state.replicas
    for rid, _ in _uncovered(view, e.data):
        out += (("replica", rid), ("model", reps[rid].model))
    return out


def _about_lost(view: View, e: ev.NodeLostEvent | ev.NodeRemovedEvent) -> list[Key]:
    node = e.data.node
    out: list[Key] = [("node", node)]
    # The fold fails every replica that held capacity on a lost node (at once, or once
    # its grace has passed): the current ones.
    for r in view.current():
        if any(s.node == node for s in r.shards):
            out += (("replica", r.id), ("model", r.model))
    return out


def _about_placed(view: View, e: Any) -> list[Key]:
    d = e.data
    return [("replica", d.replica), ("model", d.model), *(("node", s.node) for s in d.shards)]


def _about_used(view: View, e: ev.ReplicaUsedEvent) -> list[Key]:
    out: list[Key] = [("replica", e.data.replica)]
    rec = view.state.replicas.get(e.data.replica)
    if rec is not None:
        out.append(("model", rec.model))
    return out


def _about_drain(view: View, e: ev.ReplicaDrainEvent) -> list[Key]:
    d = e.data
    out: list[Key] = [("replica", d.replica), ("model", d.model)]
    if d.for_model:
        out.append(("model", d.for_model))
    return out


def _about_preemption(view: View, e: ev.PreemptionDecidedEvent) -> list[Key]:
    d = e.data
    out: list[Key] = [("model", d.for_model)]
    for v in d.victims:
        out += (("replica", v.replica), ("model", v.model))
    return out


def _about_hold(view: View, e: ev.HoldCreatedEvent) -> tuple[Key, ...]:
    return (("model", e.data.model), ("model", e.data.for_model))


def _about_data_model(view: View, e: Any) -> tuple[Key, ...]:
    """The model its data names (`data.model`)."""
    return (("model", e.data.model),)


# RULES is the one table of event types: a new type of the contract (schemas/events.py)
# gets its row here and nowhere else; what reads the log finds it through `ingest`.
RULES: dict[type, Rule] = {
    ev.ModelDeclaredEvent: Rule(_model_declared, _touch_model, _about_model),
    ev.ModelRemovedEvent: Rule(_model_removed, _touch_model, _about_model),
    ev.QuotaSetEvent: Rule(_quota_set, _touch_quota, _about_quota),
    ev.ScaleDesiredEvent: Rule(_scale_desired, _touch_desired, _about_data_model, decision=True),
    ev.ModelDemandedEvent: Rule(_model_demanded, _touch_demand, _about_data_model),
    ev.NodeInventoryEvent: Rule(_node_inventory, _touch_held, _about_inventory, _before_held),
    ev.NodeLostEvent: Rule(_node_lost, _touch_held, _about_lost, _before_held),
    ev.NodeFoundEvent: Rule(_node_found, _touch_node, _about_node),
    ev.NodeCordonedEvent: Rule(_node_cordon, _touch_node, _about_node),
    ev.NodeUncordonedEvent: Rule(_node_cordon, _touch_node, _about_node),
    ev.NodeRemovedEvent: Rule(_node_removed, _touch_held, _about_lost, _before_held),
    ev.ReplicaStateEvent: Rule(
        _replica_state, _touch_allocation, _about_placed, _before_allocation
    ),
    ev.ReplicaUsedEvent: Rule(_replica_used, _touch_replica, _about_used),
    ev.PlacementDecidedEvent: Rule(
        _placement_decided, _touch_placed, _about_placed, _before_allocation, decision=True
    ),
    ev.PlacementFailedEvent: Rule(_placement_failed, _no_touch, _about_data_model, decision=True),
    ev.ReplicaStartEvent: Rule(_replica_start, _no_touch, _about_placed),
    ev.ReplicaDrainEvent: Rule(_replica_drain, _touch_replica, _about_drain),
    ev.PreemptionDecidedEvent: Rule(
        _preemption_decided, _touch_preempting, _about_preemption, decision=True
    ),
    ev.HoldCreatedEvent: Rule(_hold_created, _touch_hold, _about_hold),
    ev.HoldReleasedEvent: Rule(_hold_released, _touch_hold, _about_data_model),
    ev.PolicyConfiguredEvent: Rule(_policy_configured, _no_touch, _about_nothing),
    ev.ViewDigestEvent: Rule(_ignored, _no_touch, _about_nothing),
}
