"""Authority in the fold: an agent speaks only for its own node's replicas, and a command
counts only on the command subject of a node the replica is on."""

from __future__ import annotations

import pytest

from schemas import events as ev
from tests.core.test_fold import MODEL, Log, at, inventory


def _two_nodes_with_r1_on_b() -> Log:
    log = Log()
    log.add(inventory("A"), node="A")
    log.add(inventory("B"), node="B")
    log.add(MODEL)
    log.add(
        ev.PlacementDecided(
            replica="r1",
            model="m",
            profile="p",
            shards=(ev.ShardSpec(node="B", gpus=(0, 1)),),
            reason="fit",
        )
    )
    assert log.rejections == []
    return log


ON_A = (ev.ShardSpec(node="A", gpus=(0, 1)),)


@pytest.mark.parametrize(
    ("data", "node", "why"),
    [
        pytest.param(
            ev.ReplicaState(replica="r1", model="m", profile="p", state="stopped", shards=ON_A),
            "A",
            "is placed on B[0,1], not A[0,1]",
            id="an agent cannot move another node's replica to itself",
        ),
        pytest.param(
            ev.ReplicaState(replica="r1", model="m", profile="p", state="failed"),
            "A",
            "agent on A reports replica r1, which has no shard there",
            id="an agent cannot fail another node's replica",
        ),
        pytest.param(
            ev.ReplicaUsed(replica="r1", at=at(2)),
            "A",
            "which has no shard there",
            id="an agent cannot report another node's replica used",
        ),
        pytest.param(
            ev.ReplicaDrain(replica="r1", model="m", reason="preempted", for_model="x"),
            "A",
            "command on A's subject for replica r1, which is on B",
            id="a drain on the wrong node's command subject",
        ),
        pytest.param(
            ev.ReplicaStart(
                replica="r1", model="m", profile="p", shards=(ev.ShardSpec(node="B", gpus=(0, 1)),)
            ),
            "A",
            "command on A's subject for replica r1, which is on B",
            id="a start on the wrong node's command subject",
        ),
    ],
)
def test_rejected(data: ev.Data, node: str, why: str) -> None:
    log = _two_nodes_with_r1_on_b()
    got = log.add(data, 2, node=node)
    assert got is not None and why in got
    r = log.view.state.replicas["r1"]
    assert r.state == "pending" and r.drained_by is None
    assert {sh.node for sh in r.shards} == {"B"}


def test_a_forged_drain_does_not_shadow_the_real_one() -> None:
    log = _two_nodes_with_r1_on_b()
    assert log.add(ev.ReplicaDrain(replica="r1", model="m", reason="scale_down"), 2, node="A")
    assert (
        log.add(ev.ReplicaDrain(replica="r1", model="m", reason="preempted"), 3, node="B") is None
    )
    assert log.view.state.replicas["r1"].drain_reason == "preempted"


def test_the_replicas_own_agent_is_heard() -> None:
    log = _two_nodes_with_r1_on_b()
    on_b = (ev.ShardSpec(node="B", gpus=(0, 1)),)
    assert (
        log.add(
            ev.ReplicaState(replica="r1", model="m", profile="p", state="starting", shards=on_b),
            2,
            node="B",
        )
        is None
    )
    assert (
        log.add(ev.ReplicaState(replica="r1", model="m", profile="p", state="ready"), 3, node="B")
        is None
    )
    assert log.view.state.replicas["r1"].state == "ready"


def test_time_comes_from_the_log_not_the_producers_claim() -> None:
    from datetime import UTC, datetime

    from schemas import codec, subjects
    from services.core import ingest

    stored = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    stored_ns = int(stored.timestamp() * 1e9)
    forged = ev.make(
        ev.ScaleDesired(model="m", replicas=1),
        id="x",
        time=datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC),
        source="agent/evil",
    )
    raw = codec.encode(forged)
    subject = subjects.subject_for(forged)
    step = ingest.Ingest()
    step.raw(1, subject, raw, stored_ns)
    assert step.view.state.time == stored + ingest.MAX_SKEW
    # A time within the skew, or one in the past, is the producer's to give.
    honest = ev.make(ev.ScaleDesired(model="m", replicas=2), id="y", time=stored, source="operator")
    got = ingest.decode_checked(codec.encode(honest), subject, "llmgw", stored_ns)
    assert not isinstance(got, str) and got.time == stored
    # Without a stored time (an old bundle), the claim stands.
    got = ingest.decode_checked(raw, subject, "llmgw")
    assert not isinstance(got, str) and got.time.year == 9999
