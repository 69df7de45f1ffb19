"""Property: folding a log whole equals folding a snapshot of a prefix plus the rest.

Random logs of every event type over a small universe (3 nodes, 5 replicas, 3 models) so
events collide: duplicates, states going backwards, reports from the wrong node, drains
of unknown replicas, inventories that shrink under replicas, models redeclared with
other profiles, and bytes that are not events at all. A snapshot is the canonical
encoding (`encode_state` -> `decode_state` -> `View(state)`), as the projector stores it.
"""

from __future__ import annotations

from collections.abc import KeysView
from datetime import UTC, datetime, timedelta

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import codec, subjects
from schemas import events as ev
from services.core import scheduling
from services.core.catalog import class_rank
from services.core.ingest import Ingest
from services.core.view import ReplicaRecord, View, decode_state, digest, encode_state

T0 = datetime(2026, 1, 1, tzinfo=UTC)
NODES = ("n0", "n1", "n2")
REPLICAS = ("r0", "r1", "r2", "r3", "r4")
MODELS = ("m0", "m1", "m2")
STATES = ("pending", "starting", "loading", "ready", "draining", "stopped", "failed")

node = st.sampled_from(NODES)
model = st.sampled_from(MODELS)
replica = st.sampled_from(REPLICAS)
gpus = st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True).map(
    lambda g: tuple(sorted(g))
)
shards = st.lists(
    st.builds(ev.ShardSpec, node=node, gpus=gpus),
    min_size=1,
    max_size=2,
    unique_by=lambda s: s.node,
).map(tuple)
profile = st.builds(
    ev.ProfileSpec,
    name=st.sampled_from(("p1", "p2")),
    gpus=st.integers(1, 2),
    shards=st.integers(1, 2),
    cpu_cores=st.sampled_from((0.0, 4.0, 40.0)),
    memory_gb=st.sampled_from((0.0, 64.0)),
)
minutes = st.integers(0, 600).map(lambda m: T0 + timedelta(minutes=m))

data = st.one_of(
    st.builds(
        ev.ModelDeclared,
        name=model,
        cls=st.sampled_from(("critical", "standard", "opportunistic")),
        min=st.integers(0, 2),
        aliases=st.lists(st.sampled_from(("a0", "a1")), max_size=1, unique=True).map(tuple),
        profiles=st.lists(profile, max_size=2, unique_by=lambda p: p.name).map(tuple),
    ),
    st.builds(ev.ModelRemoved, name=model),
    st.builds(
        ev.QuotaSet,
        owners=st.lists(
            st.builds(
                ev.OwnerQuota,
                name=st.sampled_from(("default", "t1")),
                parent=st.sampled_from((None, "default", "t9")),
                guarantee=st.builds(ev.Resources, gpus=st.integers(0, 4)),
            ),
            max_size=2,
        ).map(tuple),
    ),
    st.builds(ev.ScaleDesired, model=st.sampled_from((*MODELS, "a0")), replicas=st.integers(0, 3)),
    st.builds(
        ev.NodeInventory,
        node=node,
        gpus=st.integers(0, 5).map(
            lambda n: tuple(
                ev.GpuInfo(index=i, uuid=f"u{i}", model="H100", memory_gb=80.0) for i in range(n)
            )
        ),
        cpu_cores=st.sampled_from((8.0, 64.0)),
        memory_gb=st.sampled_from((64.0, 512.0)),
    ),
    st.builds(ev.NodeLost, node=node, reason=st.just("heartbeats")),
    st.builds(ev.NodeCordoned, node=node),
    st.builds(ev.NodeUncordoned, node=node),
    st.builds(
        ev.ReplicaState,
        replica=replica,
        model=model,
        profile=st.sampled_from(("p1", "p2")),
        state=st.sampled_from(STATES),
        shards=st.one_of(st.just(()), shards),
        reason=st.sampled_from((None, "oom")),
    ),
    st.builds(ev.ReplicaUsed, replica=replica, at=minutes),
    st.builds(
        ev.PlacementDecided,
        replica=replica,
        model=model,
        profile=st.sampled_from(("p1", "p2")),
        shards=shards,
        reason=st.just("fit"),
    ),
    st.builds(
        ev.PlacementFailed,
        model=model,
        profiles=st.just(("p1",)),
        live=st.integers(0, 2),
        desired=st.integers(0, 3),
        reason=st.sampled_from(("no_fit", "quota_limit")),
    ),
    st.builds(ev.ReplicaStart, replica=replica, model=model, profile=st.just("p1"), shards=shards),
    st.builds(
        ev.ReplicaDrain,
        replica=st.sampled_from((*REPLICAS, "ghost")),
        model=model,
        reason=st.sampled_from(("preempted", "scale_down", "node_drain", "placement_timeout")),
        for_model=st.sampled_from((None, "m0")),
    ),
    st.builds(
        ev.PreemptionDecided,
        for_model=model,
        outcome=st.sampled_from(("preempted", "no_fit", "awaiting")),
        victims=st.lists(
            st.builds(
                ev.Victim,
                replica=replica,
                model=model,
                cls=st.just("standard"),
                tier=st.integers(0, 4),
                above_min=st.booleans(),
                gpus=st.integers(1, 2),
            ),
            max_size=2,
        ).map(tuple),
    ),
    st.builds(ev.HoldCreated, model=model, for_model=model, until=minutes),
    st.builds(ev.HoldReleased, model=model, reason=st.just("expired")),
    st.builds(ev.ViewDigest, seq=st.integers(0, 9), digest=st.just("x")),
)


@st.composite
def records(draw: st.DrawFn) -> list[tuple[str, bytes]]:
    """(subject, body) pairs: events on their subject (or a wrong node's), repeats of
    earlier ones (duplicates), and garbage."""
    out: list[tuple[str, bytes]] = []
    for i in range(draw(st.integers(1, 60))):
        kind = draw(st.integers(0, 19))
        if kind == 0 and out:
            out.append(out[draw(st.integers(0, len(out) - 1))])
            continue
        if kind == 1:
            out.append(("llmgw.catalog.quota", draw(st.sampled_from((b"", b"{", b'{"type":"x"}')))))
            continue
        d = draw(data)
        t = T0 + timedelta(seconds=draw(st.integers(0, 3600)))
        e = ev.make(d, id=f"e{i}", time=t, source="test")
        at = draw(node)
        try:
            subject = subjects.subject_for(e, node=at)
        except (ValueError, IndexError):
            subject = subjects.replica_subject(at, "r0")
        out.append((subject, codec.encode(e)))
    return out


def fold(view: View | None, recs: list[tuple[int, str, bytes]]) -> Ingest:
    f = Ingest(view)
    for seq, subject, body in recs:
        f.raw(seq, subject, body)
    return f


def whole_and_restored(log: list[tuple[str, bytes]], data: st.DataObject) -> tuple[View, View]:
    """The log folded whole, and folded to a drawn point, snapshotted, restored and
    folded on to its end."""
    recs = [(i, s, b) for i, (s, b) in enumerate(log, start=1)]
    split = data.draw(st.integers(0, len(recs)))
    whole = fold(None, recs).view
    head = fold(None, recs[:split])
    restored = fold(View(decode_state(encode_state(head.view.state))), recs[split:]).view
    return whole, restored


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(log=records(), data=st.data())
def test_fold_whole_equals_snapshot_plus_rest(
    log: list[tuple[str, bytes]], data: st.DataObject
) -> None:
    recs = [(i, s, b) for i, (s, b) in enumerate(log, start=1)]
    split = data.draw(st.integers(0, len(recs)))
    whole = fold(None, recs)
    head = fold(None, recs[:split])
    restored = View(decode_state(encode_state(head.view.state)))
    tail = fold(restored, recs[split:])
    assert encode_state(tail.view.state) == encode_state(whole.view.state)
    assert digest(tail.view.state) == digest(whole.view.state)
    assert head.touched.rejections + tail.touched.rejections == whole.touched.rejections
    assert head.touched.decisions + tail.touched.decisions == whole.touched.decisions
    # The derived indexes agree too: what is allocated where, and what is free.
    assert tail.view.inventory.allocations() == whole.view.inventory.allocations()
    for n in NODES:
        assert tail.view.inventory.free_gpus(n) == whole.view.inventory.free_gpus(n)
        assert tail.view.inventory.free_cpu(n) == whole.view.inventory.free_cpu(n)


Indexes = tuple[
    list[str],
    list[str],
    list[str],
    dict[str, list[float]],
    dict[str, list[str]],
    dict[str, int],
    list[str],
    list[str],
]


def _indexes(view: View) -> Indexes:
    """The view's replica indexes, loads sorted (their order is not kept), the current
    replicas per model sorted (nor is theirs), and every replica in `ordinal` order."""
    loads = {m: sorted(xs) for m, xs in view.load_times().items()}
    of_model = {m: sorted(r.id for r in view.current_of(m)) for m in view.current_models()}
    live = {m: view.live_count(m) for m in (*MODELS, "a0", "a1", "ghost")}
    return (
        [r.id for r in view.current()],
        [r.id for r in view.failed_since(T0)],
        [r.id for r in view.timed_out_since(T0)],
        loads,
        of_model,
        {m: n for m, n in live.items() if n},
        [r.id for r in view.pending_placed()],
        sorted(view.replicas, key=view.ordinal),
    )


def _walked(view: View) -> Indexes:
    """The same, by walking every replica ever placed."""
    reps = view.replicas.values()
    current = [r.id for r in reps if r.state in ev.HOLDING_STATES]
    # A gang with a failed shard counts from that shard's failure (`failed_on`).
    failed = [r.id for r in reps if (r.state == "failed" or r.failed_on) and r.updated_at >= T0]
    timed_out = _timed_out_walked(view, T0)
    loads: dict[str, list[float]] = {}
    of_model: dict[str, list[str]] = {}
    live: dict[str, int] = {}
    for r in reps:
        if r.ready_at is not None:
            loads.setdefault(r.model, []).append((r.ready_at - r.created_at).total_seconds())
        if r.id in current:
            of_model.setdefault(r.model, []).append(r.id)
        if r.live:
            live[r.model] = live.get(r.model, 0) + 1
    pending = [
        r.id
        for r in reps
        if r.state == "pending" and r.placed_by is not None and r.drained_by is None
    ]
    return (
        current,
        failed,
        timed_out,
        {m: sorted(xs) for m, xs in loads.items()},
        {m: sorted(ids) for m, ids in of_model.items()},
        live,
        pending,
        list(view.replicas),
    )


def _timed_out_walked(view: View, since: datetime) -> list[str]:
    """The replicas drained for placement_timeout created, or first ready, at or after
    `since`, by walking every replica."""
    return [
        r.id
        for r in view.replicas.values()
        if r.drain_reason == "placement_timeout"
        and (r.created_at >= since or (r.ready_at is not None and r.ready_at >= since))
    ]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(log=records(), data=st.data(), since=minutes)
def test_the_replica_indexes_are_what_a_walk_over_every_replica_finds(
    log: list[tuple[str, bytes]], data: st.DataObject, since: datetime
) -> None:
    """The indexes a pass and the policy read instead of every replica ever placed (the
    ones holding capacity, in creation order and per model; the live counts per model;
    the pending placements; the failed ones and the ones drained for placement_timeout
    since a time; the load times; the creation order) say what the walk says, after any
    log, live and from a snapshot taken anywhere in it."""
    whole, restored = whole_and_restored(log, data)
    for view in (whole, restored):
        assert _indexes(view) == _walked(view)
        want = [
            r.id
            for r in view.replicas.values()
            if (r.state == "failed" or r.failed_on) and r.updated_at >= since
        ]
        assert [r.id for r in view.failed_since(since)] == want
        assert [r.id for r in view.broken()] == [
            r.id for r in view.replicas.values() if r.failed_on and r.holds_capacity
        ]
        assert [r.id for r in view.timed_out_since(since)] == _timed_out_walked(view, since)
        for m in MODELS:
            assert view.live_count(m) == sum(
                1 for r in view.replicas.values() if r.model == m and r.live
            )


def test_a_stopped_replica_drained_for_placement_timeout_is_read_by_a_pass_again() -> None:
    """A drain for placement_timeout that arrives after the replica stopped changes
    nothing it holds, but a pass reads such a replica (it is why a node is avoided):
    it is not current, yet the index of timed-out placements follows the drain, not
    only the state."""
    sh = (ev.ShardSpec(node="n0", gpus=(0,)),)
    gpu = ev.GpuInfo(index=0, uuid="GPU-0", model="H100", memory_gb=80.0)
    log: list[ev.Data] = [
        ev.NodeInventory(node="n0", gpus=(gpu,), cpu_cores=8.0, memory_gb=64.0),
        ev.ModelDeclared(name="m0", cls="standard", profiles=(ev.ProfileSpec(name="p1", gpus=1),)),
        ev.PlacementDecided(replica="r0", model="m0", profile="p1", shards=sh, reason="t"),
        ev.ReplicaState(replica="r0", model="m0", profile="p1", state="stopped", shards=sh),
        ev.ReplicaDrain(replica="r0", model="m0", reason="placement_timeout"),
    ]
    f = Ingest(None)
    for i, d in enumerate(log, start=1):
        e = ev.make(d, id=f"e{i}", time=T0 + timedelta(seconds=i), source="test")
        f.raw(i, subjects.subject_for(e, node="n0"), codec.encode(e))
    assert f.touched.rejections == []
    assert [r.id for r in f.view.current()] == []
    assert [r.id for r in f.view.timed_out_since(T0)] == ["r0"]
    assert _indexes(f.view) == _walked(f.view)


# A busier universe for the replica indexes: every replica has its own GPU (r<i> on node
# n<i%3>, GPU i//3), so placements and reports are accepted and many replicas of one
# model live, stop, fail, drain and come back together; a model with an alias, and one
# removed and declared again.
BUSY = tuple(f"r{i}" for i in range(9))


def _home(rid: str) -> ev.ShardSpec:
    i = int(rid[1:])
    return ev.ShardSpec(node=NODES[i % 3], gpus=(i // 3,))


busy_data = st.one_of(
    st.builds(
        ev.PlacementDecided,
        replica=st.sampled_from(BUSY),
        model=st.sampled_from(("m0", "m1", "a0")),
        profile=st.just("p1"),
        shards=st.just(()),
        reason=st.just("fit"),
    ),
    st.builds(
        ev.ReplicaState,
        replica=st.sampled_from(BUSY),
        model=st.sampled_from(("m0", "m1", "a0")),
        profile=st.just("p1"),
        state=st.sampled_from(STATES),
        shards=st.just(()),
    ),
    st.builds(
        ev.ReplicaDrain,
        replica=st.sampled_from(BUSY),
        model=st.just("m0"),
        reason=st.sampled_from(("preempted", "scale_down", "node_drain", "placement_timeout")),
        for_model=st.sampled_from((None, "m1")),
    ),
    st.builds(ev.NodeLost, node=node, reason=st.just("heartbeats")),
    st.builds(ev.ModelRemoved, name=st.just("m1")),
    st.just(
        ev.ModelDeclared(name="m1", cls="standard", profiles=(ev.ProfileSpec(name="p1", gpus=1),))
    ),
)


def _busy_setup() -> list[ev.Data]:
    gpus = tuple(ev.GpuInfo(index=i, uuid=f"u{i}", model="H100", memory_gb=80.0) for i in range(3))
    p = (ev.ProfileSpec(name="p1", gpus=1),)
    return [
        *(ev.NodeInventory(node=n, gpus=gpus, cpu_cores=64.0, memory_gb=512.0) for n in NODES),
        ev.ModelDeclared(name="m0", cls="standard", aliases=("a0",), profiles=p),
        ev.ModelDeclared(name="m1", cls="standard", profiles=p),
    ]


@st.composite
def busy_records(draw: st.DrawFn) -> list[tuple[str, bytes]]:
    """(subject, body) pairs: the set-up, then replica events on their replica's node."""
    log = _busy_setup() + draw(st.lists(busy_data, max_size=80))
    out: list[tuple[str, bytes]] = []
    t = T0
    for i, d in enumerate(log):
        t += timedelta(seconds=draw(st.integers(0, 120)))
        home = None
        if isinstance(d, ev.PlacementDecided | ev.ReplicaState):
            sh = _home(d.replica)
            home = sh.node
            if isinstance(d, ev.PlacementDecided) or draw(st.booleans()):
                d = msgspec.structs.replace(d, shards=(sh,))
        elif isinstance(d, ev.ReplicaDrain):
            home = _home(d.replica).node
        e = ev.make(d, id=f"e{i}", time=t, source="test")
        out.append((subjects.subject_for(e, node=home), codec.encode(e)))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(log=busy_records(), data=st.data())
def test_the_replica_indexes_hold_through_busy_replica_lives(
    log: list[tuple[str, bytes]], data: st.DataObject
) -> None:
    """The same, on logs where most events are accepted and many replicas of one model
    (under its name and its alias) change together."""
    whole, restored = whole_and_restored(log, data)
    for view in (whole, restored):
        assert _indexes(view) == _walked(view)


# Timed-out lives: two models scaled to a few replicas each (one of them under its name
# and its alias); each replica is placed, perhaps drained for placement_timeout, perhaps
# comes up, perhaps stops or fails, in that order in the log but at times of their own,
# so a first ready can be stamped before the placement or long after it (the index's key
# moves), and the lives of the replicas interleave.
@st.composite
def timed_out_records(draw: st.DrawFn) -> list[tuple[str, bytes]]:
    minute = timedelta(minutes=1)
    steps: list[tuple[int, str, str, datetime]] = []
    for rid in BUSY[:6]:
        placed = T0 + draw(st.integers(0, 40)) * minute
        life = [("place", placed)]
        if draw(st.booleans()):
            life.append(("timeout", placed + draw(st.integers(0, 30)) * minute))
        if draw(st.booleans()):
            life.append(("ready", placed + draw(st.integers(-5, 30)) * minute))
        if draw(st.booleans()):
            end = placed + draw(st.integers(1, 40)) * minute
            life.append((draw(st.sampled_from(("stopped", "failed"))), end))
        at = sorted(draw(st.lists(st.integers(0, 99), min_size=len(life), max_size=len(life))))
        steps += [(pos, rid, kind, t) for pos, (kind, t) in zip(at, life, strict=True)]
    out: list[tuple[str, bytes]] = []
    wanted = [ev.ScaleDesired(model=m, replicas=draw(st.integers(0, 5))) for m in ("m0", "m1")]
    for i, d in enumerate([*_busy_setup(), *wanted]):
        e = ev.make(d, id=f"s{i}", time=T0, source="test")
        out.append((subjects.subject_for(e), codec.encode(e)))
    for i, (_, rid, kind, t) in enumerate(sorted(steps, key=lambda s: s[0])):
        sh = _home(rid)
        name = ("m0", "a0", "m1")[int(rid[1:]) % 3]
        data: ev.Data
        if kind == "place":
            data = ev.PlacementDecided(
                replica=rid, model=name, profile="p1", shards=(sh,), reason="fit"
            )
        elif kind == "timeout":
            data = ev.ReplicaDrain(replica=rid, model=name, reason="placement_timeout")
        else:
            data = ev.ReplicaState(replica=rid, model=name, profile="p1", state=kind, shards=(sh,))
        e = ev.make(data, id=f"e{i}", time=t, source="test")
        out.append((subjects.subject_for(e, node=sh.node), codec.encode(e)))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(log=timed_out_records(), data=st.data())
def test_the_timed_out_index_is_what_a_walk_finds_from_any_time(
    log: list[tuple[str, bytes]], data: st.DataObject
) -> None:
    """The placements drained for placement_timeout, read from any time (each creation
    and first ready, and the second either side), are what a walk over every replica
    finds, live and from a snapshot; a stopped one is no longer current."""
    whole, restored = whole_and_restored(log, data)
    second = timedelta(seconds=1)
    for view in (whole, restored):
        assert _indexes(view) == _walked(view)
        times = {t for r in view.replicas.values() for t in (r.created_at, r.ready_at) if t}
        for at in sorted({*times, *(t - second for t in times), *(t + second for t in times)}):
            assert [r.id for r in view.timed_out_since(at)] == _timed_out_walked(view, at)


class _Walked(View):
    """A view whose pass finds its replicas by walking every one ever placed: per model
    name, those holding capacity and every one drained for placement_timeout however
    old, as the current replicas were before a stopped one left them, and all of the
    latter as the timed-out placements."""

    __slots__ = ()

    def _read(self) -> list[ReplicaRecord]:
        return [
            r
            for r in self.replicas.values()
            if r.holds_capacity or r.drain_reason == "placement_timeout"
        ]

    def current_of(self, model: str) -> list[ReplicaRecord]:
        return [r for r in self._read() if r.model == model]

    def current_models(self) -> KeysView[str]:
        return dict.fromkeys(r.model for r in self._read()).keys()

    def timed_out_since(self, since: datetime) -> list[ReplicaRecord]:
        return [r for r in self.replicas.values() if r.drain_reason == "placement_timeout"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(log=timed_out_records(), data=st.data())
def test_a_pass_on_the_timed_out_index_decides_what_a_walk_would(
    log: list[tuple[str, bytes]], data: st.DataObject
) -> None:
    """A pass reads the current replicas, which hold capacity, and the timed-out
    placements from a time on (the nodes it avoids, the backoffs a late ready ends): it
    decides what a pass that walked every replica ever placed would, at times just
    inside and just past each of those windows after any time in the log, whether its
    nodes are avoided for longer than a backoff lasts or not."""
    recs = [(i, s, b) for i, (s, b) in enumerate(log, start=1)]
    view = fold(None, recs).view
    raw = encode_state(view.state)
    config = scheduling.Config(avoid_for_s=data.draw(st.sampled_from((1.0, 600.0))))
    times = sorted(
        {t for r in view.replicas.values() for t in (r.created_at, r.ready_at, r.updated_at) if t}
    )
    windows = (config.avoid_for_s, config.start_backoff_s, config.start_backoff_max_s)
    after = data.draw(st.sampled_from([0.0, *(w + d for w in windows for d in (-5.0, 5.0))]))
    now = data.draw(st.sampled_from(times)) + timedelta(seconds=after)
    bounded = scheduling.plan(View(decode_state(raw)), now, config)
    walked = scheduling.plan(_Walked(decode_state(raw)), now, config)
    assert [codec.encode(o.event) for o in bounded.outputs] == [
        codec.encode(o.event) for o in walked.outputs
    ]
    assert bounded.satisfied == walked.satisfied


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(log=busy_records(), data=st.data(), later=st.integers(0, 300))
def test_a_pass_on_the_indexes_decides_what_a_walk_over_every_replica_would(
    log: list[tuple[str, bytes]], data: st.DataObject, later: int
) -> None:
    """The scheduler's pass reads the indexes: it drains the replicas of removed models
    and the placements past their start timeout in the order of `replicas`, and counts a
    model satisfied, as a walk over every replica says; live and from a snapshot (whose
    `replicas` come back in id order, so its drains may come in another order, but the
    same ones)."""
    whole, restored = whole_and_restored(log, data)
    assert whole.state.time is not None
    now = whole.state.time + timedelta(seconds=later)
    config = scheduling.Config()
    plans = [scheduling.plan(v, now, config) for v in (whole, restored)]
    assert sorted(codec.encode(o.event) for o in plans[0].outputs) == sorted(
        codec.encode(o.event) for o in plans[1].outputs
    )
    assert plans[0].satisfied == plans[1].satisfied
    for view, plan in zip((whole, restored), plans, strict=True):
        _check_pass(view, plan, now, config)


def _check_pass(
    view: View, plan: scheduling.Plan, now: datetime, config: scheduling.Config
) -> None:
    resolve = view.catalog.resolve
    drains: list[tuple[str, str]] = []
    timed_out: set[str] = set()
    for r in view.replicas.values():
        m = resolve(r.model)
        if not r.shards:
            continue  # a drain goes to a node; this replica has none to go to
        if m is None:
            if r.holds_capacity and r.drained_by is None and r.state != "draining":
                drains.append((r.id, "model_removed"))
        elif (
            r.state == "pending"
            and r.placed_by is not None
            and r.drained_by is None
            and (now - r.created_at).total_seconds() >= config.start_timeout_s
        ):
            drains.append((r.id, "placement_timeout"))
            timed_out.add(m.name)
    got = [(o.event.data.replica, o.event.data.reason) for o in plan.outputs[: len(drains)]]
    assert got == drains
    assert not any(
        isinstance(o.event, ev.ReplicaDrainEvent)
        and o.event.data.reason in ("model_removed", "placement_timeout")
        for o in plan.outputs[len(drains) :]
    )
    ranked = sorted(view.catalog.models(), key=lambda m: (-class_rank(m.cls), m.name))
    for m in ranked:
        reps = [r for r in view.replicas.values() if r.live and resolve(r.model) is m]
        live = len(reps)
        desired = view.desired_for(m.name)
        placed = sum(
            1
            for o in plan.outputs
            if isinstance(o.event, ev.PlacementDecidedEvent) and o.event.data.model == m.name
        )
        stopped = sum(
            1
            for o in plan.outputs
            if isinstance(o.event, ev.ReplicaDrainEvent)
            and o.event.data.reason == "scale_down"
            and o.event.data.model == m.name
        )
        if m.name in timed_out:
            assert m.name not in plan.satisfied
            assert placed == stopped == 0
            continue
        assert placed <= max(desired - live, 0)
        assert stopped <= max(live - desired, 0)
        if all(r.shards for r in reps):  # a replica with no shard gets no drain
            assert stopped == max(live - desired, 0)
        if live == desired:
            assert m.name in plan.satisfied
    order = [m.name for m in ranked]
    assert plan.satisfied == sorted(plan.satisfied, key=order.index)
