"""What a held request is told (services.core.coldstart), pure: the predicted start from
the log's placement-to-ready times (median of the latest, x1.5, the default without
any), what is left of a start under way, and when a model cannot be placed (a hold, or
the policy's failed answer, once the plane is trying or since the wait began)."""

from __future__ import annotations

from datetime import timedelta

import msgspec
import pytest

from schemas import events as ev
from services.core import coldstart, fold
from tests.core.test_fold import MODEL, T0, Log, at, inventory

SHARDS = (ev.ShardSpec(node="n1", gpus=(0, 1)),)


def _log() -> Log:
    log = Log()
    assert log.add(msgspec.structs.replace(MODEL, min=0)) is None  # on demand
    assert log.add(inventory(gpus=8)) is None
    return log


def _start(log: Log, rid: str, placed: float, ready: float | None) -> None:
    """A replica placed at minute `placed`, ready at minute `ready` (None: not yet)."""
    d = ev.PlacementDecided(replica=rid, model="m", profile="p", shards=SHARDS, reason="fits")
    assert log.add(d, placed) is None
    if ready is not None:
        s = ev.ReplicaState(replica=rid, model="m", profile="p", state="ready", shards=SHARDS)
        assert log.add(s, ready) is None
        stop = ev.ReplicaState(replica=rid, model="m", profile="p", state="stopped", shards=SHARDS)
        assert log.add(stop, ready + 0.01) is None


def _model(log: Log):  # type: ignore[no-untyped-def]
    m = log.view.catalog.resolve("m")
    assert m is not None
    return m


def test_no_start_in_the_log_is_the_default_bound_and_retry() -> None:
    log = _log()
    look = coldstart.outlook(log.view, _model(log), at(0), floor_s=30)
    assert look.typical_s is None
    assert look.bound_s == look.remaining_s == coldstart.DEFAULT_READY_S
    assert look.retry_after == 600


@pytest.mark.parametrize(
    ("loads_min", "typical_s"),
    [
        pytest.param([2], 120, id="one start: itself"),
        pytest.param([1, 2, 10], 120, id="the median, not the slowest"),
        pytest.param([10] * 5 + [1] * coldstart.HISTORY, 60, id="only the latest HISTORY"),
    ],
)
def test_the_prediction_is_the_median_of_the_latest_starts(
    loads_min: list[float], typical_s: float
) -> None:
    log = _log()
    t = 0.0
    for i, load in enumerate(loads_min):
        _start(log, f"r{i}", t, t + load)
        t += load + 1
    look = coldstart.outlook(log.view, _model(log), at(t))
    assert look.typical_s == pytest.approx(typical_s)
    assert look.bound_s == pytest.approx(typical_s * coldstart.MARGIN)
    assert look.remaining_s == pytest.approx(typical_s)


def test_a_start_under_way_leaves_what_it_has_not_spent_and_the_floor_holds() -> None:
    log = _log()
    _start(log, "r0", 0, 2)  # two minutes
    _start(log, "r1", 10, None)  # placed at minute 10
    m = _model(log)
    assert coldstart.outlook(log.view, m, at(10.5)).remaining_s == pytest.approx(90)
    late = coldstart.outlook(log.view, m, at(20))
    assert late.remaining_s == 1.0 and late.retry_after == 1
    # A fast model still waits the floor: a scheduler's pass and a victim's drain.
    log2 = _log()
    _start(log2, "r0", 0, 0.01)
    assert coldstart.outlook(log2.view, _model(log2), at(1), floor_s=30).bound_s == 30


def _failed(log: Log, minutes: float, outcome: str) -> None:
    assert (
        log.add(
            ev.PlacementFailed(
                model="m",
                profiles=("p",),
                live=0,
                desired=1,
                reason="no_fit",
                why={"p": "needs 2 GPUs"},
            ),
            minutes,
            eid=f"pf{minutes}",
        )
        is None
    )
    e = ev.make(
        ev.PreemptionDecided(for_model="m", outcome=outcome, trigger=f"pf{minutes}"),
        id=f"pd{minutes}",
        time=at(minutes),
        source="test",
        causation=f"pf{minutes}",
    )
    log.seq += 1
    assert fold.apply(log.view, e, seq=log.seq) is None


@pytest.mark.parametrize(
    ("outcome", "code"),
    [
        pytest.param("no_fit", "no_fit", id="no room even preempting"),
        pytest.param("no_candidates", "no_candidates", id="nothing may be stopped"),
        pytest.param("quota_limit", "quota_limit", id="the owner's limit"),
        pytest.param("preempted", None, id="preempted: on its way"),
        pytest.param("awaiting", None, id="awaiting victims: on its way"),
        pytest.param("fits", None, id="fits: on its way"),
    ],
)
def test_the_policys_answer_since_the_wait_began_says_whether_it_can_be_placed(
    outcome: str, code: str | None
) -> None:
    log = _log()
    _failed(log, 5, outcome)
    m = _model(log)
    got = coldstart.unplaceable(log.view, m, at(6), since=at(4))
    assert (None if got is None else got.code) == code
    if got is not None:
        assert "needs 2 GPUs" in got.reason and got.retry_after_s is None


def test_an_old_failure_of_a_model_asked_for_nothing_is_old_news() -> None:
    log = _log()
    _failed(log, 5, "no_fit")
    m = _model(log)
    # The wait began after it, and the model is not asked for: the demand asks again.
    assert log.add(ev.ScaleDesired(model="m", replicas=0), 5.5) is None
    assert coldstart.unplaceable(log.view, m, at(7), since=at(6)) is None
    # Asked for and still failing: said at once.
    assert log.add(ev.ScaleDesired(model="m", replicas=1), 6.5) is None
    got = coldstart.unplaceable(log.view, m, at(7), since=at(7))
    assert got is not None and got.code == "no_fit"
    # A placement after the failure: it is on its way.
    d = ev.PlacementDecided(replica="r9", model="m", profile="p", shards=SHARDS, reason="fits")
    assert log.add(d, 8) is None
    assert coldstart.unplaceable(log.view, m, at(9), since=at(7)) is None


def test_a_hold_says_when_it_ends() -> None:
    log = _log()
    until = T0 + timedelta(minutes=10)
    assert log.add(ev.HoldCreated(model="m", for_model="big", until=until), 1) is None
    got = coldstart.unplaceable(log.view, _model(log), at(9), since=at(9))
    assert got is not None and got.code == "held"
    assert got.retry_after_s == pytest.approx(60)
    assert "gave up its room for big" in got.reason
    assert coldstart.unplaceable(log.view, _model(log), at(11), since=at(9)) is None


def test_a_model_on_a_lost_node_is_stranded_until_its_grace_ends_or_the_node_is_back() -> None:
    from services.cli import status
    from tests.scenario import Scenario

    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", "8xH100-80GB")
    s.node("n2", "8xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["tp4:4"])
    s.replica("c1", "chat", on=("n2", [0, 1, 2, 3]), created="-10m", ready="-9m")
    s.at("+0s")
    s.emit(ev.NodeLost(node="n2", reason="no heartbeat for 16s", grace_s=60))
    v = s.view()
    m = v.catalog.resolve("chat")
    assert m is not None
    now = v.state.time
    assert now is not None
    got = coldstart.stranded(v, m, now)
    assert got is not None and got.nodes == ("n2",) and got.reason == "no heartbeat for 16s"
    assert got.until == now + timedelta(seconds=60)
    # The grace's rest, then a start as long as its last one (a minute).
    assert got.retry_after == 120
    words = got.words("chat", now)
    assert words.startswith("chat is not routed: its replicas are on node n2, lost (")
    assert "they fail at 14:01:00 UTC (in 60s) unless n2 is back" in words
    # status: 1/1 live, and why the gateway sends it nothing.
    row = next(x for x in status.summary(v, 0, now)["models"] if x["model"] == "chat")
    assert row["live"] == 1
    assert (
        status.model_note(row)
        == "not routed: node n2 lost; fail at 2026-11-29T14:01:00Z unless back"
    )
    # Back: nothing stranded.
    s.emit(ev.NodeFound(node="n2"))
    v = s.view()
    assert coldstart.stranded(v, m, now) is None


def test_a_replica_starting_elsewhere_is_no_strand() -> None:
    from tests.scenario import Scenario

    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", "8xH100-80GB")
    s.node("n2", "8xH100-80GB")
    s.model("chat", cls="critical", min=1, max=2, profiles=["tp4:4"])
    s.replica("c1", "chat", on=("n2", [0, 1, 2, 3]), ready="-9m")
    s.replica("c2", "chat", on=("n1", [0, 1, 2, 3]))
    s.emit(ev.NodeLost(node="n2", reason="gone", grace_s=60))
    v = s.view()
    m = v.catalog.resolve("chat")
    assert m is not None and v.state.time is not None
    assert coldstart.stranded(v, m, v.state.time) is None
