"""The contract's on-demand pieces: `model.demanded`, `scale.desired`'s reason and the
model's `target_inflight` / `idle_after_s`, and how the fold keeps them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from schemas import codec, subjects
from schemas import events as ev
from schemas.errors import EventDecodeError
from services.core import fold
from services.core.view import View, decode_state, encode_state

T0 = datetime(2026, 1, 1, 12, tzinfo=UTC)
PROFILE = (ev.ProfileSpec(name="p", gpus=1),)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def apply(view: View, data: ev.Data, s: float, eid: str, source: str = "test") -> None:
    e = ev.make(data, id=eid, time=at(s), source=source)
    rej = fold.apply(view, e, seq=view.state.seq + 1, subject=subjects.subject_for(e))
    assert rej is None, rej


def declared(view: View, **kw: object) -> None:
    apply(view, ev.ModelDeclared(name="m", min=0, max=4, profiles=PROFILE, **kw), 0, "d")


def demanded(waiting: int, since: float = 0, inflight: int = 0) -> ev.ModelDemanded:
    return ev.ModelDemanded(model="m", waiting=waiting, since=at(since), inflight=inflight)


def test_declared_fields_have_their_documented_defaults() -> None:
    raw = (
        b'{"id":"a","type":"model.declared","time":"2026-01-01T00:00:00Z","source":"x",'
        b'"data":{"name":"m","profiles":[{"name":"p","gpus":1}]}}'
    )
    d = codec.decode(raw).data
    assert isinstance(d, ev.ModelDeclared)
    assert d.target_inflight is None and d.effective_target_inflight == 8
    assert d.idle_after_s == 900.0 == ev.DEFAULT_IDLE_AFTER_S


@pytest.mark.parametrize(
    ("data", "where"),
    [
        pytest.param(
            '{"model":"m","waiting":-1,"since":"2026-01-01T00:00:00Z"}',
            "waiting",
            id="negative waiting",
        ),
        pytest.param(
            '{"model":"m","waiting":1,"since":"2026-01-01T00:00:00"}',
            "since",
            id="since without a zone",
        ),
        pytest.param(
            '{"model":"","waiting":1,"since":"2026-01-01T00:00:00Z"}', "model", id="empty model"
        ),
        pytest.param('{"waiting":1,"since":"2026-01-01T00:00:00Z"}', "model", id="no model"),
    ],
)
def test_a_demand_out_of_the_contract_is_a_decode_error(data: str, where: str) -> None:
    raw = (
        '{"id":"a","type":"model.demanded","time":"2026-01-01T00:00:00Z","source":"x",'
        f'"data":{data}}}'
    ).encode()
    with pytest.raises(EventDecodeError, match=where):
        codec.decode(raw)


def test_demand_has_its_subject_and_the_stream_stores_it() -> None:
    e = ev.make(demanded(3), id="x", time=T0, source="gateway")
    s = subjects.subject_for(e, "r")
    assert s == subjects.demand_subject("m", "r") == "r.gateway.demand.m"
    assert subjects.parse(s, "r") == subjects.Parsed("gateway.demand", model="m")
    assert subjects.check(e, s, "r") is None
    assert subjects.check(e, subjects.scale_subject("m", "r"), "r") is not None
    assert "r.gateway.>" in subjects.stream_subjects("r")
    odd = ev.make(
        ev.ModelDemanded(model="meta/llama-3.1-8b", waiting=1, since=T0),
        id="y",
        time=T0,
        source="gateway",
    )
    s = subjects.subject_for(odd)
    assert subjects.parse(s).model == "meta/llama-3.1-8b"


def test_the_view_keeps_the_last_demand_per_model() -> None:
    v = View()
    declared(v)
    apply(v, demanded(1, since=1), 1, "q1")
    apply(v, demanded(3, since=1, inflight=2), 2, "q2")
    d = v.state.demand["m"]
    assert (d.waiting, d.since, d.at, d.inflight, d.id) == (3, at(1), at(2), 2, "q2")
    assert d.answered_by is None
    # A report older than the one kept does not bring its count back.
    apply(v, demanded(1, since=1), 1.5, "late")
    assert v.state.demand["m"].id == "q2"


def test_an_alias_demands_the_model_it_names() -> None:
    v = View()
    apply(v, ev.ModelDeclared(name="m", min=0, aliases=("chat",), profiles=PROFILE), 0, "d")
    apply(v, ev.ModelDemanded(model="chat", waiting=2, since=T0), 1, "q")
    assert set(v.state.demand) == {"m"}


def test_a_scale_answers_the_demand_before_it_and_records_who_asked() -> None:
    v = View()
    declared(v)
    apply(v, demanded(2), 1, "q1")
    apply(
        v,
        ev.ScaleDesired(model="m", replicas=1, reason="demand: 2 waiting since 12:00:00"),
        2,
        "s1",
        "scheduler",
    )
    assert v.state.demand["m"].answered_by == "s1"
    rec = v.state.scaled["m"]
    assert (rec.replicas, rec.at, rec.source, rec.by_hand) == (1, at(2), "scheduler", False)
    last = v.state.decisions[-1]
    assert (last.type, last.id, last.outcome) == ("scale.desired", "s1", "scaled")
    assert "demand: 2 waiting" in last.summary
    # A second scale does not move the first answer; a new demand is unanswered.
    apply(v, ev.ScaleDesired(model="m", replicas=2), 3, "s2", "operator/me")
    assert v.state.demand["m"].answered_by == "s1"
    assert v.state.scaled["m"].by_hand
    apply(v, demanded(5), 4, "q2")
    assert v.state.demand["m"].answered_by is None


def test_an_old_log_folds_as_before() -> None:
    """A scale.desired without a reason is an operator's: no decision recorded, the
    desired count as always; a log without demand has none in the view."""
    v = View()
    declared(v)
    apply(v, ev.ScaleDesired(model="m", replicas=2), 1, "s")
    assert v.state.desired == {"m": 2}
    assert v.state.demand == {}
    assert not v.state.decisions
    assert v.state.scaled["m"].by_hand


def test_demand_and_scale_records_survive_a_snapshot() -> None:
    v = View()
    declared(v)
    apply(v, demanded(2), 1, "q1")
    apply(v, ev.ScaleDesired(model="m", replicas=1, reason="r"), 2, "s1")
    again = View(decode_state(encode_state(v.state)))
    assert again.state.demand == v.state.demand
    assert again.state.scaled == v.state.scaled
    assert msgspec.json.decode(encode_state(v.state))["demand"]["m"]["waiting"] == 2
