"""`policy.configured`: the settings a preemption service decides with, in the log.

The pure rule (when a leader records, with which id), the fold (the latest wins, an old
log folds as before), the projector's store, and services on a real broker: one record
per change of settings, none from a standby that takes over with the same ones.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.js.client import JetStreamContext

from schemas import codec, subjects
from schemas import events as ev
from services.bus import EmbeddedBroker
from services.core import fold, policy
from services.core.view import View, digest
from services.preemption import settings
from services.preemption.config import Config
from services.projector import store
from tests.preemption_service.conftest import FAST, Clock, of_type, running, stored, until
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(30)

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
A = Config(policy=policy.Config(hold_s=20.0, min_lifetime_s=0.0), drain_grace_s=5.0)
B = dataclasses.replace(A, policy=policy.Config(hold_s=99.0))


def _record(config: Config, last: ev.Event | None, holder: str = "p") -> ev.PolicyConfiguredEvent:
    assert last is None or isinstance(last, ev.PolicyConfiguredEvent)
    e = settings.record(config, last, NOW, holder)
    assert isinstance(e, ev.PolicyConfiguredEvent)
    return e


# ---------------------------------------------------------------------- the rule


def test_record_carries_the_policy_and_the_drain_grace() -> None:
    e = _record(A, None)
    d = e.data
    assert (d.hold_s, d.eviction_grace_s, d.min_lifetime_s, d.max_victims) == (20, 600, 0, 3)
    assert d.drain_grace_s == 5.0
    assert settings.policy_of(d) == A.policy
    assert subjects.subject_for(e) == "llmgw.preemption.policy"
    assert subjects.check(e, "llmgw.preemption.policy") is None
    assert subjects.check(e, "llmgw.preemption.decided.policy") is not None
    assert codec.decode(codec.encode(e)) == e


@pytest.mark.parametrize(
    ("config", "holder", "recorded"),
    [
        pytest.param(A, "p", False, id="same settings: nothing"),
        pytest.param(A, "other", False, id="same settings, another holder: nothing"),
        pytest.param(B, "p", True, id="other settings: a new record"),
    ],
)
def test_a_leader_records_only_what_the_log_does_not_show(
    config: Config, holder: str, recorded: bool
) -> None:
    last = _record(A, None)
    assert (settings.record(config, last, NOW, holder) is not None) is recorded


def test_ids_are_derived_so_racing_leaders_publish_one_and_a_return_gets_its_own() -> None:
    a1 = _record(A, None, "p1")
    # Two standbys with the same settings, each before it saw the other's record.
    assert _record(A, None, "p2").id == a1.id
    b = _record(B, a1)
    a2 = _record(A, b)
    assert len({a1.id, b.id, a2.id}) == 3


# ---------------------------------------------------------------------- the fold


def test_fold_keeps_the_latest_and_an_old_log_has_none() -> None:
    s = Scenario("2026-01-01T12:00:00Z")
    s.node("n1", "2xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["one:1"])
    assert s.view().state.policy is None
    view = s.view()
    a = _record(A, None)
    b = _record(B, a)
    assert fold.apply(view, a, seq=10, subject="llmgw.preemption.policy") is None
    assert fold.apply(view, b, seq=11, subject="llmgw.preemption.policy") is None
    rec = view.state.policy
    assert rec is not None
    assert (rec.seq, rec.id, rec.settings.hold_s) == (11, b.id, 99.0)


async def test_projector_store_keeps_the_record(tmp_path: Path) -> None:
    view = View()
    fold.apply(view, _record(A, None), seq=1)
    db = await store.open_db(tmp_path / "view.db")
    try:
        await store.write_view(db, view)
        loaded = await store.load_view(db)
    finally:
        await db.close()
    assert loaded.state.policy == view.state.policy
    assert digest(loaded.state) == digest(view.state)


# ---------------------------------------------------------------------- the service


async def test_leader_records_once_and_a_standby_with_the_same_settings_adds_nothing(
    nats_server: EmbeddedBroker, js: JetStreamContext
) -> None:
    clock = Clock(NOW)
    config = dataclasses.replace(FAST, policy=A.policy, drain_grace_s=A.drain_grace_s)
    async with running(nats_server.url, holder="a", clock=clock, config=config) as (a, _):
        await until(lambda: a.view.state.policy is not None)
        rec = a.view.state.policy
        assert rec is not None and rec.settings.holder == "a"
        assert settings.policy_of(rec.settings) == A.policy
        # Asked again while leading: the log already shows these settings.
        assert await a.record_settings() is None
    # A clean stop hands the lease over; the next leader has the same settings.
    async with running(nats_server.url, holder="b", clock=clock, config=config) as (b, _):
        await until(lambda: b.view.state.policy is not None)
        assert await b.record_settings() is None
    log = await stored(js)
    assert len(of_type(log, ev.PolicyConfiguredEvent)) == 1


async def test_a_restart_with_other_settings_records_them(
    nats_server: EmbeddedBroker, js: JetStreamContext
) -> None:
    clock = Clock(NOW)
    first = dataclasses.replace(FAST, policy=A.policy)
    second = dataclasses.replace(FAST, policy=B.policy)
    async with running(nats_server.url, holder="a", clock=clock, config=first) as (a, _):
        await until(lambda: a.view.state.policy is not None)
    async with running(nats_server.url, holder="a", clock=clock, config=second) as (b, _):
        await until(
            lambda: b.view.state.policy is not None and b.view.state.policy.settings.hold_s == 99
        )
    recs = [x.event for x in of_type(await stored(js), ev.PolicyConfiguredEvent)]
    assert [e.data.hold_s for e in recs] == [20.0, 99.0]  # type: ignore[union-attr]
