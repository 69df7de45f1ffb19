"""The table of event types (`fold.RULES`) and the one ingest step over it.

Every type of the contract has its row, so a new type cannot reach a view unfolded; and
the step records what the projector writes: the touched keys, dead letters with their
reason, rejections, and the view's position past every message.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas import codec, subjects
from schemas import events as ev
from services.core import fold, ingest
from services.core.ingest import Dead, Gap, Ingest

T = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_every_event_type_of_the_contract_has_its_row() -> None:
    assert set(fold.RULES) == set(ev.EVENT_CLASSES)


def _raw(step: Ingest, data: ev.Data, n: int, subject: str | None = None) -> ev.Event | None:
    e = ev.make(data, id=f"e{n}", time=T, source="test")
    return step.raw(n, subject or subjects.subject_for(e), codec.encode(e))


def test_ingest_marks_what_changed_and_records_dead_letters_and_rejections() -> None:
    step = Ingest()
    assert _raw(step, ev.ScaleDesired(model="m", replicas=2), 1) is not None
    assert step.touched.desired == {"m"} and step.verdict is None

    # The wrong subject: a dead letter, not folded, and the position moves past it.
    assert (
        _raw(step, ev.ScaleDesired(model="x", replicas=9), 2, subjects.scale_subject("m")) is None
    )
    assert isinstance(step.verdict, Dead)
    assert "wrong subject for its data" in step.verdict.reason
    assert "x" not in step.view.state.desired

    # Bytes that do not decode: a dead letter too.
    assert step.raw(3, subjects.scale_subject("m"), b"{not json") is None
    assert [d.seq for d in step.touched.dead] == [2, 3]

    # A drain for an unknown replica is rejected: recorded, nothing marked.
    drain = ev.ReplicaDrain(replica="r-1", model="m", reason="scale_down")
    assert _raw(step, drain, 4, subjects.command_subject("n1", "drain")) is not None
    assert [r.seq for r in step.touched.rejections] == [4]
    assert step.verdict is step.touched.rejections[0]
    assert not step.touched.replicas
    assert step.seq == 4 and step.touched.count == 4

    with pytest.raises(Gap):
        step.raw(6, subjects.scale_subject("m"), b"{}")


def test_about_names_the_entities_of_an_event_applied_or_not() -> None:
    view = Ingest().view
    drain = ev.make(
        ev.ReplicaDrain(replica="r-1", model="m", reason="preempted", for_model="big"),
        id="d",
        time=T,
        source="test",
    )
    keys = ingest.about(view, drain, subjects.command_subject("n1", "drain"))
    assert keys == {("replica", "r-1"), ("model", "m"), ("model", "big"), ("node", "n1")}
    assert sorted(map(ingest.label, keys)) == ["model/big", "model/m", "node/n1", "replica/r-1"]


def test_a_report_that_fails_replicas_touches_them_and_is_about_them() -> None:
    """A node's report that no longer has a replica's GPUs fails it in the fold: the
    store rewrites its row (touched), and its history shows the report (about)."""
    step = Ingest()

    def report(gpus: int) -> ev.NodeInventory:
        return ev.NodeInventory(
            node="n1",
            gpus=tuple(
                ev.GpuInfo(index=i, uuid=f"g{i}", model="H100", memory_gb=80) for i in range(gpus)
            ),
            cpu_cores=64,
            memory_gb=512,
        )

    _raw(step, ev.ModelDeclared(name="m", profiles=(ev.ProfileSpec(name="p", gpus=4),)), 1)
    _raw(step, report(8), 2)
    for n, gpus in ((3, (0, 1, 2, 3)), (4, (4, 5, 6, 7))):
        shards = (ev.ShardSpec(node="n1", gpus=gpus),)
        _raw(
            step,
            ev.PlacementDecided(replica=f"r{n}", model="m", profile="p", shards=shards, reason="f"),
            n,
        )
    small = ev.make(report(4), id="e5", time=T, source="test")
    assert ingest.about(step.view, small, subjects.subject_for(small)) == {
        ("node", "n1"),
        ("replica", "r4"),
        ("model", "m"),
    }
    step.touched.clear()
    assert _raw(step, report(4), 5) is not None
    assert step.touched.replicas == {"r4"} and step.touched.nodes == {"n1"}
    assert step.view.replicas["r4"].state == "failed"
    assert step.view.replicas["r3"].state == "pending"
