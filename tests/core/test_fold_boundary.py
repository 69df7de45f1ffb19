"""The fold at the boundary of an agent's authority, pure: a report creates no replica
(only a placement does, as a kubelet creates no pod), an endpoint is on its node's
recorded address, and a time a producer claims is bounded by the event's, which ingest
bounds by when the log stored it."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest

from schemas import codec, subjects
from schemas import events as ev
from services.core import autoscale, ingest, routing
from services.core.fold import Dead
from tests.core.test_fold import MODEL, Log, at, inventory

pytestmark = [pytest.mark.timeout(30)]

ON_B = (ev.ShardSpec(node="B", gpus=(0, 1)),)
FAR = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)


def _r1_on_b(address: str = "10.0.0.2") -> Log:
    """Nodes A and B (B at `address`), and replica r1 placed on B's GPUs 0 and 1."""
    log = Log()
    log.add(msgspec.structs.replace(inventory("A"), address="10.0.0.1"), node="A")
    log.add(msgspec.structs.replace(inventory("B"), address=address), node="B")
    log.add(MODEL)
    log.add(ev.PlacementDecided(replica="r1", model="m", profile="p", shards=ON_B, reason="fit"))
    assert log.rejections == []
    return log


def _state(
    rid: str, st: str, shards: tuple[ev.ShardSpec, ...] = ON_B, endpoint: str | None = None
) -> ev.ReplicaState:
    return ev.ReplicaState(
        replica=rid,
        model="m",
        profile="p",
        state=st,  # type: ignore[arg-type]
        shards=shards,
        endpoint=endpoint,
    )


ON_A = (ev.ShardSpec(node="A", gpus=(6, 7)),)


@pytest.mark.parametrize(
    ("reports", "node", "why"),
    [
        pytest.param(
            [_state("chat-feedfacecafe", s, ON_A) for s in ("starting", "loading", "ready")],
            "A",
            "replica chat-feedfacecafe was never placed on A",
            id="an agent cannot invent a replica on its own node",
        ),
        pytest.param(
            [_state("chat-feedfacecafe", "ready", ON_A, "http://10.0.0.1:20001")],
            "A",
            "was never placed on A",
            id="an agent cannot invent a ready replica with an endpoint",
        ),
        pytest.param(
            [_state("chat-feedfacecafe", "ready", ON_B)],
            "A",
            "was never placed on A",
            id="an agent cannot invent a replica on another node",
        ),
        pytest.param(
            [_state("r1", "stopped", (ev.ShardSpec(node="B", gpus=(2, 3)),))],
            "B",
            "replica r1 is placed on B[0,1], not B[2,3]",
            id="other GPUs of the same node are named",
        ),
        pytest.param(
            [_state("r1", "ready", endpoint="http://10.9.9.9:20001")],
            "B",
            "endpoint http://10.9.9.9:20001 is not on B's address 10.0.0.2",
            id="an endpoint on another host",
        ),
        pytest.param(
            [_state("r1", "ready", endpoint="http://10.0.0.1:20001")],
            "B",
            "is not on B's address 10.0.0.2",
            id="an endpoint on another node's address",
        ),
        pytest.param(
            [_state("r1", "ready", endpoint="http://[::1]:8080")],
            "B",
            "is not on B's address",
            id="an endpoint on the loopback of whoever reads it",
        ),
    ],
)
def test_rejected(reports: list[ev.ReplicaState], node: str, why: str) -> None:
    log = _r1_on_b()
    before = log.view.inventory.free_gpus("A"), log.view.inventory.free_gpus("B")
    for i, d in enumerate(reports, 2):
        got = log.add(d, i, node=node)
        assert got is not None and why in got, got
    assert set(log.view.state.replicas) == {"r1"}
    r = log.view.state.replicas["r1"]
    assert r.state == "pending" and r.endpoint is None and r.shards == ON_B
    assert (log.view.inventory.free_gpus("A"), log.view.inventory.free_gpus("B")) == before


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [
        pytest.param("10.0.0.2", "http://10.0.0.2:20001", id="its address"),
        pytest.param("GPU-B.example", "https://gpu-b.example:443", id="its name, any case"),
        pytest.param("::1", "http://[::1]:20001", id="its IPv6 address"),
        pytest.param("", "http://anywhere:20001", id="no address said (an older agent)"),
    ],
)
def test_the_placed_replica_reports_on_its_address(address: str, endpoint: str) -> None:
    log = _r1_on_b(address)
    for i, st in enumerate(("starting", "loading"), 2):
        assert log.add(_state("r1", st), i, node="B") is None
    assert log.add(_state("r1", "ready", endpoint=endpoint), 5, node="B") is None
    r = log.view.state.replicas["r1"]
    assert r.state == "ready" and r.endpoint == endpoint
    m = log.view.catalog.resolve("m")
    assert m is not None and [x.id for x in routing.candidates(log.view, m)] == ["r1"]


def test_a_node_that_moved_address_is_not_sent_requests_at_the_old_one() -> None:
    log = _r1_on_b()
    assert log.add(_state("r1", "ready", endpoint="http://10.0.0.2:20001"), 2, node="B") is None
    m = log.view.catalog.resolve("m")
    assert m is not None and routing.candidates(log.view, m)
    log.add(msgspec.structs.replace(inventory("B"), address="10.0.0.3"), 3, node="B")
    assert routing.candidates(log.view, m) == []


def test_a_report_for_a_replica_never_placed_is_a_dead_letter_too() -> None:
    """Ingest keeps it among the rejections (the view says why) and the dead letters
    (the projector puts it on the DLQ with that reason)."""
    step = ingest.Ingest()
    seq = 0
    for data, node in [(inventory("A"), "A"), (MODEL, None)]:
        seq += 1
        e = ev.make(data, id=f"e{seq}", time=at(seq), source="test")
        step.raw(seq, subjects.subject_for(e, node=node), codec.encode(e))
    forged = ev.make(_state("chat-feedfacecafe", "ready", ON_A), id="x", time=at(9), source="a")
    subject = subjects.subject_for(forged, node="A")
    step.raw(seq + 1, subject, codec.encode(forged))
    assert "chat-feedfacecafe" not in step.view.state.replicas
    [rej] = step.touched.rejections
    [dead] = step.touched.dead
    assert isinstance(dead, Dead) and dead.seq == seq + 1 == rej.seq
    assert dead.reason == rej.reason == "replica chat-feedfacecafe was never placed on A"
    assert dead.subject == subject and codec.decode(dead.data) == forged
    # Other rejections stay rejections only.
    step.raw(seq + 2, subject, codec.encode(msgspec.structs.replace(forged, id="y")))
    assert len(step.touched.dead) == 2
    used = ev.make(ev.ReplicaUsed(replica="nobody", at=at(9)), id="z", time=at(9), source="a")
    step.raw(seq + 3, subjects.subject_for(used, node="A"), codec.encode(used))
    assert len(step.touched.dead) == 2 and len(step.touched.rejections) == 3


def _ready_r1(log: Log) -> None:
    assert log.add(_state("r1", "ready", endpoint="http://10.0.0.2:20001"), 2, node="B") is None


@pytest.mark.parametrize(
    ("claimed", "want"),
    [
        pytest.param(FAR, at(10), id="9999-12-31 is the event's time"),
        pytest.param(at(30), at(10), id="a clock twenty minutes fast"),
        pytest.param(at(9), at(9), id="an honest time stands"),
    ],
)
def test_a_claimed_use_is_bounded_by_the_events_time(claimed: datetime, want: datetime) -> None:
    log = _r1_on_b()
    _ready_r1(log)
    assert log.add(ev.ReplicaUsed(replica="r1", at=claimed), 10, node="B") is None
    r = log.view.state.replicas["r1"]
    assert r.last_used_at == want
    # A later true report moves it on.
    assert log.add(ev.ReplicaUsed(replica="r1", at=at(20)), 21, node="B") is None
    assert r.last_used_at == at(20)


def test_a_far_future_use_does_not_keep_an_on_demand_model_up() -> None:
    """One report at 9999-12-31: idle after `idle_after_s` from the event's time all the
    same, and the reason says so in minutes, not in millions of days."""
    log = Log()
    log.add(msgspec.structs.replace(inventory("B"), address="10.0.0.2"), node="B")
    log.add(msgspec.structs.replace(MODEL, min=0, idle_after_s=600))
    log.add(ev.ScaleDesired(model="m", replicas=1, reason="demand"), 1)
    log.add(ev.PlacementDecided(replica="r1", model="m", profile="p", shards=ON_B, reason="fit"), 1)
    _ready_r1(log)
    assert log.add(ev.ReplicaUsed(replica="r1", at=FAR), 10, node="B") is None
    r = log.view.state.replicas["r1"]
    assert r.last_used_at == at(10) and r.idle_s(at(25)) == 15 * 60
    assert autoscale.decide(log.view, at(15)).next_due == at(20)
    got = autoscale.decide(log.view, at(25)).decisions
    assert [(d.model, d.replicas, d.reason) for d in got] == [("m", 0, "idle 10m")], got


def test_a_claimed_demand_since_is_bounded_by_the_events_time() -> None:
    log = _r1_on_b()
    assert log.add(ev.ModelDemanded(model="m", waiting=1, since=FAR), 10) is None
    assert log.view.state.demand["m"].since == at(10)
    assert log.add(ev.ModelDemanded(model="m", waiting=1, since=at(9)), 11) is None
    assert log.view.state.demand["m"].since == at(9)


def test_a_replay_bounds_a_claimed_time_as_the_live_fold_did() -> None:
    """Ingest bounds the event's time by when the broker stored it, and the fold the
    claimed `at` by that: the same stored message gives the same view, live or replayed."""
    stored = at(10)
    stored_ns = int(stored.timestamp() * 1e9)
    views = []
    for _ in range(2):
        step = ingest.Ingest()
        log = _r1_on_b()
        step.view = log.view
        _ready_r1(log)
        forged = ev.make(ev.ReplicaUsed(replica="r1", at=FAR), id="u", time=FAR, source="a")
        step.raw(
            log.seq + 1, subjects.subject_for(forged, node="B"), codec.encode(forged), stored_ns
        )
        views.append(step.view.state.replicas["r1"].last_used_at)
    assert views == [stored + ingest.MAX_SKEW] * 2
