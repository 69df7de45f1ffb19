"""The gateways' fleet: announcements heard, a silent gateway out within its lease, a
goodbye at once (`services.bus.fleet`, `services.core.fleet`)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from nats.aio.client import Client

from schemas import fleet as schema
from schemas import subjects
from schemas.fleet import GatewayAnnouncement
from services.bus.fleet import Fleet, ModelLoad, Traffic
from services.core.fleet import EXPIRE_S, Roster

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def ann(g: str, **kw: object) -> GatewayAnnouncement:
    return GatewayAnnouncement(gateway=g, started=T0, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the roster (pure)


def test_roster_expires_a_silent_gateway_past_its_lease() -> None:
    r = Roster()
    assert r.heard(ann("a"), 0.0) is True
    assert r.heard(ann("b"), 0.0) is True
    assert r.heard(ann("a", inflight=3), 0.5) is False  # only its load changed
    assert r.expire(EXPIRE_S) == []
    assert r.expire(EXPIRE_S + 0.01) == ["b"]
    assert set(r.live()) == {"a"}
    assert r.live()["a"].inflight == 3
    # One that fell silent and speaks again is back at once.
    assert r.heard(ann("b"), 2.0) is True


def test_roster_goodbye_is_at_once_and_a_straggler_does_not_bring_it_back() -> None:
    r = Roster()
    r.heard(ann("a"), 0.0)
    assert r.heard(ann("a", leaving=True), 0.1) is True
    assert r.live() == {}
    assert r.heard(ann("a"), 0.2) is False  # sent before its goodbye, arrived after
    assert r.live() == {}


def test_roster_gives_a_slow_announcer_four_of_its_intervals() -> None:
    r = Roster()
    r.heard(ann("slow", every=2.0), 0.0)
    assert r.expire(7.9) == []
    assert r.expire(8.1) == ["slow"]


def test_announcement_decode_refuses_what_is_not_one() -> None:
    assert schema.decode(b"not json") is None
    assert schema.decode(b'{"gateway": ""}') is None
    assert schema.decode(b'{"gateway": "a", "started": "2026-12-01T00:00:00Z", "every": 0}') is None
    a = schema.decode(schema.encode(ann("a", address="http://h:1", routing="prefix")))
    assert a is not None and a.address == "http://h:1"
    # An unknown field (a newer gateway's) is ignored.
    b = schema.decode(b'{"gateway": "a", "started": "2026-12-01T00:00:00Z", "new": 1}')
    assert b is not None and b.gateway == "a"


def test_announce_subjects_are_not_stored() -> None:
    s = subjects.gateway_announce_subject("g.1")
    assert subjects.gateway_of_announcement(s) == "g.1"
    assert subjects.gateway_of_announcement("llmgw.fleet.rollcall") is None
    stored = subjects.stream_subjects()
    for subject in (s, subjects.gateway_rollcall_subject()):
        assert not any(_matches(p, subject) for p in stored)


def _matches(pattern: str, subject: str) -> bool:
    p, t = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(t) > i
        if i >= len(t) or (tok != "*" and tok != t[i]):
            return False
    return len(p) == len(t)


# ---------------------------------------------------------------- on a real broker


async def test_fleet_hears_gateways_and_loses_a_silent_one_within_its_lease(nc: Client) -> None:
    changes: list[set[str]] = []
    load = {"a": 0}
    a = Fleet(nc, me=lambda: ann("a", inflight=load["a"], every=0.05), every_s=0.05, expire_s=0.3)
    b = Fleet(nc, me=lambda: ann("b", every=0.05), every_s=0.05, expire_s=0.3)
    reader = Fleet(nc, expire_s=0.3, on_change=lambda live: changes.append(set(live)))
    await a.start()
    await b.start()
    await reader.start()
    try:
        live = await reader.settled()
        assert set(live) == {"a", "b"}  # the roll call answered, before a whole interval
        assert set(a.live()) == {"a", "b"}  # itself included
        load["a"] = 7
        await _until(lambda: reader.live()["a"].inflight == 7)
        # b falls silent (killed: no goodbye): out within its lease.
        assert b._task is not None
        b._task.cancel()
        t = asyncio.get_running_loop().time()
        await _until(lambda: "b" not in reader.live())
        assert asyncio.get_running_loop().time() - t < 0.3 + 0.2
        assert changes[-1] == {"a"}
        # a says goodbye: out at once, not a lease later.
        await a.stop()
        await _until(lambda: "a" not in reader.live(), within=0.2)
    finally:
        for f in (a, b, reader):
            await f.stop()


async def test_a_forged_announcement_on_another_gateways_subject_is_ignored(nc: Client) -> None:
    reader = Fleet(nc)
    await reader.start()
    try:
        forged = schema.encode(ann("victim", leaving=True))
        await nc.publish(subjects.gateway_announce_subject("other"), forged)
        await nc.publish(subjects.gateway_announce_subject("x"), b"\xff garbage")
        await nc.publish(subjects.gateway_announce_subject("real"), schema.encode(ann("real")))
        await _until(lambda: "real" in reader.live())
        assert set(reader.live()) == {"real"}
    finally:
        await reader.stop()


async def _until(ok: object, within: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while not ok():  # type: ignore[operator]
        assert loop.time() < end, "not within the time"
        await asyncio.sleep(0.01)


def test_the_fleets_traffic_sums_the_gateways_and_keeps_a_gone_ones_count() -> None:
    """The dashboard beside `up`'s gateway processes: requests per model only grow (a
    restarted process's count starts again at 0), in flight and held are the live ones'."""
    now = [0.0]
    fleet = Fleet(None, clock=lambda: now[0])
    traffic = Traffic(fleet)

    def say(g: str, requests: int, inflight: int, held: int = 0) -> None:
        load = {"chat": ModelLoad(requests=requests, inflight=inflight, held=held)}
        fleet.roster.heard(ann(g, models=load), now[0])

    say("a", 10, 2)
    say("b", 5, 1, held=3)
    assert traffic.counts() == ({"chat": 15}, {"chat": 3})
    assert traffic.held() == {"chat": 3}
    now[0] = 0.5
    say("a", 12, 0)
    now[0] = 1.2  # b silent past its lease: gone, its 5 kept
    assert traffic.counts() == ({"chat": 17}, {"chat": 0})
    say("c", 1, 1)  # b's restart, a new id from 0
    assert traffic.counts() == ({"chat": 18}, {"chat": 1})
    assert traffic.held() == {"chat": 0}
