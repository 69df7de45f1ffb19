"""The preemption service on a real broker: what it publishes for a trigger, what it does
not, holds released, and two services at once.

Each test builds the cluster by publishing events directly (see `conftest.full_cluster`),
runs the service in-process with a clock the test moves, and reads the stream back.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from schemas import events as ev
from schemas import ids
from services.bus import EmbeddedBroker, connect
from services.core import policy
from services.core.reaction import SHOWN, bounded
from services.preemption import PreemptionService
from tests.preemption_service.conftest import (
    CONFIG,
    FAST,
    T0,
    Clock,
    acked_through,
    failed,
    full_cluster,
    of_type,
    publish,
    running,
    stored,
    until,
)
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(30)


async def test_decides_and_publishes_decision_drains_and_holds(
    nats_server: EmbeddedBroker, js: JetStreamContext, clock: Clock
) -> None:
    s = full_cluster()
    trigger = failed(s)
    async with running(nats_server.url, holder="p1", clock=clock):
        await publish(js, s)
        await until(lambda: acked_through(js, len(s.events())))
    log = await stored(js)

    decided = of_type(log, ev.PreemptionDecidedEvent)
    assert len(decided) == 1
    d = decided[0].event
    assert isinstance(d, ev.PreemptionDecidedEvent)
    assert d.id == ids.derived(trigger.id, "decided")
    assert (d.causation, d.correlation) == (trigger.id, trigger.id)
    assert decided[0].subject == "llmgw.preemption.decided.chat"
    assert d.data.outcome == "preempted"
    assert d.data.trigger == trigger.id
    assert [v.replica for v in d.data.victims] == ["b1", "b2"]

    drains = of_type(log, ev.ReplicaDrainEvent)
    assert [(x.subject, x.event.data.replica) for x in drains] == [  # type: ignore[union-attr]
        ("llmgw.cmd.n1.replica.drain", "b1"),
        ("llmgw.cmd.n1.replica.drain", "b2"),
    ]
    for x in drains:
        e = x.event
        assert isinstance(e, ev.ReplicaDrainEvent)
        assert e.data.reason == "preempted"
        assert e.data.for_model == "chat"
        assert e.id == ids.derived(trigger.id, f"drain:{e.data.replica}")
        assert (e.causation, e.correlation) == (d.id, trigger.id)

    holds = of_type(log, ev.HoldCreatedEvent)
    assert len(holds) == 1
    h = holds[0].event
    assert isinstance(h, ev.HoldCreatedEvent)
    assert (h.data.model, h.data.for_model) == ("batch", "chat")
    assert h.data.until == clock.now + timedelta(seconds=CONFIG.hold_s)
    assert h.id == ids.derived(trigger.id, "hold:batch")
    assert (h.causation, h.correlation) == (d.id, trigger.id)
    # In order: the decision before what it causes.
    assert decided[0].seq < drains[0].seq < drains[1].seq < holds[0].seq


async def test_second_trigger_while_victims_drain_awaits_and_stops_nothing(
    nats_server: EmbeddedBroker, js: JetStreamContext, clock: Clock
) -> None:
    # Both triggers are in the stream, in one publish, before the service decides the
    # first: the second must still be decided on a view that holds the first decision.
    s = full_cluster()
    failed(s)
    second = failed(s)
    async with running(nats_server.url, holder="p1", clock=clock):
        await publish(js, s)
        await until(lambda: acked_through(js, len(s.events())))
    log = await stored(js)
    decided = [x.event for x in of_type(log, ev.PreemptionDecidedEvent)]
    assert [e.data.outcome for e in decided] == ["preempted", "awaiting"]  # type: ignore[union-attr]
    assert decided[1].causation == second.id
    assert len(of_type(log, ev.ReplicaDrainEvent)) == 2


async def test_backlog_trigger_answered_by_a_later_decision_is_not_decided_again(
    nats_server: EmbeddedBroker, js: JetStreamContext, clock: Clock
) -> None:
    # A log older than the service: two triggers for chat wait for it. The first one's
    # decision, stored after both, answers the second as well.
    s = full_cluster()
    first = failed(s)
    failed(s)
    await publish(js, s)
    async with running(nats_server.url, holder="p1", clock=clock) as (svc, _):
        await until(lambda: acked_through(js, len(s.events())))
        assert (svc.stats.decided, svc.stats.superseded) == (1, 1)
    log = await stored(js)
    decided = [x.event for x in of_type(log, ev.PreemptionDecidedEvent)]
    assert [e.causation for e in decided] == [first.id]
    assert len(of_type(log, ev.ReplicaDrainEvent)) == 2


async def test_quota_limit_stops_nothing(
    nats_server: EmbeddedBroker, js: JetStreamContext, clock: Clock
) -> None:
    s = full_cluster()
    failed(s, reason="quota_limit")
    async with running(nats_server.url, holder="p1", clock=clock) as (svc, _):
        await publish(js, s)
        await until(lambda: acked_through(js, len(s.events())))
        assert svc.stats.ignored == 1
    log = await stored(js)
    assert of_type(log, ev.PreemptionDecidedEvent) == []
    assert of_type(log, ev.ReplicaDrainEvent) == []
    assert of_type(log, ev.HoldCreatedEvent) == []


async def test_hold_released_when_expired_once(
    nats_server: EmbeddedBroker, js: JetStreamContext, clock: Clock
) -> None:
    s = full_cluster()
    failed(s)
    async with running(nats_server.url, holder="p1", clock=clock) as (svc, _):
        await publish(js, s)
        await until(lambda: "batch" in svc.view.state.holds)
        hold = svc.view.state.holds["batch"]
        # At its `until` exactly the hold is still on (View.hold_end): passes release
        # nothing.
        clock.now = hold.until
        ticks = svc.stats.ticks
        await until(lambda: svc.stats.ticks >= ticks + 3)
        assert "batch" in svc.view.state.holds
        assert svc.stats.holds_released == 0
        clock.now = hold.until + timedelta(microseconds=1)
        await until(lambda: "batch" not in svc.view.state.holds)
        # A few more passes over the view find nothing more to release.
        ticks = svc.stats.ticks
        await until(lambda: svc.stats.ticks >= ticks + 3)
    released = [x.event for x in of_type(await stored(js), ev.HoldReleasedEvent)]
    assert len(released) == 1
    r = released[0]
    assert isinstance(r, ev.HoldReleasedEvent)
    assert (r.data.model, r.data.reason) == ("batch", "expired")
    assert r.id == ids.derived(hold.created_by, "released")
    assert r.causation == hold.created_by


async def test_hold_released_when_its_model_is_satisfied(
    nats_server: EmbeddedBroker, js: JetStreamContext, clock: Clock
) -> None:
    s = full_cluster()
    failed(s)
    async with running(nats_server.url, holder="p1", clock=clock) as (svc, _):
        n = await publish(js, s)
        await until(lambda: "batch" in svc.view.state.holds)
        # The victims stop, and chat is placed in the room they left.
        s.state("b1", "stopped").state("b2", "stopped")
        s.replica("c1", "chat", on=("n1", [0, 1, 2, 3]), state="pending")
        await publish(js, s, since=n)
        await until(lambda: "batch" not in svc.view.state.holds)
    released = [x.event for x in of_type(await stored(js), ev.HoldReleasedEvent)]
    assert [r.data.reason for r in released] == ["satisfied"]  # type: ignore[union-attr]


async def test_two_services_one_decision_and_standby_takes_over(
    nats_server: EmbeddedBroker, js: JetStreamContext, clock: Clock
) -> None:
    s = full_cluster()
    first = failed(s)
    async with (
        running(nats_server.url, holder="a", clock=clock) as (a, a_task),
        running(nats_server.url, holder="b", clock=clock, lead=False) as (b, _),
    ):
        n = await publish(js, s)
        # The decision first, then the acks: right after a publish, the consumer's info
        # can show nothing pending before the broker has counted the new trigger.
        await until(lambda: a.stats.decided == 1)
        await until(lambda: acked_through(js, n))
        assert not b.is_leader
        assert (a.stats.decided, b.stats.decided) == (1, 0)

        # The leader dies: no release, so the standby must wait out the lease.
        a_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a_task
        await until(lambda: b.is_leader and b.consuming, within=a.config.lease_ttl_s + 2)

        second = failed(s, "chat2")
        n = await publish(js, s, since=n)
        await until(lambda: b.stats.decided == 1)
        await until(lambda: acked_through(js, n))
        assert a.stats.decided == 1

    log = await stored(js)
    decided = [x.event for x in of_type(log, ev.PreemptionDecidedEvent)]
    assert [e.causation for e in decided] == [first.id, second.id]
    drained = [x.event.data.replica for x in of_type(log, ev.ReplicaDrainEvent)]  # type: ignore[union-attr]
    assert drained == ["b1", "b2", "b3", "b4"]


def test_published_decision_lists_a_bounded_number_of_candidates() -> None:
    # Every replica of a full cluster is a candidate; the event lists the first SHOWN
    # (every victim and trial among them) and counts them all.
    s = Scenario(T0)
    for n in range(10):
        s.node(f"n{n}", "8xH100-80GB")
    s.model("batch", cls="opportunistic", min=0, max=80, profiles=["one:1"])
    s.model("chat", cls="critical", min=1, profiles=["tp8:8"])
    for n in range(10):
        for g in range(8):
            s.replica(f"b{n}-{g}", "batch", on=(f"n{n}", [g]), ready="-3h", used=f"-{n + 20}m")
    d = policy.plan(s.view(), "chat", s.now, policy.Config(max_victims=8))
    assert d.outcome == "preempted" and len(d.candidates) == SHOWN and d.considered == 80
    data = bounded(d.to_event_data("t"))
    assert len(data.candidates) == SHOWN
    assert data.considered == 80
    shown = {c.replica for c in data.candidates}
    assert {v.replica for v in data.victims} <= shown
    assert all(set(t.victims) <= shown for t in data.trials)


async def test_clean_stop_hands_over_before_the_lease_runs_out(
    nats_server: EmbeddedBroker, js: JetStreamContext, clock: Clock
) -> None:
    # A lease long enough that waiting it out would fail the test: the stopped leader
    # must release it, and the standby takes it on its next try (every third of a TTL).
    slow = dataclasses.replace(FAST, lease_ttl_s=6.0)
    nc = await connect(nats_server.url, "a")
    a = PreemptionService(nc, nc.jetstream(), clock=clock, holder="a", config=slow)
    stop = asyncio.Event()
    task = asyncio.create_task(a.run(stop))
    try:
        await until(lambda: a.is_leader)
        async with running(nats_server.url, holder="b", clock=clock, config=slow, lead=False) as (
            b,
            _,
        ):
            assert not b.is_leader
            stop.set()
            await asyncio.wait_for(task, 5)
            assert await a.lease.current_holder() != "a"
            await until(lambda: b.is_leader, within=slow.lease_ttl_s / 3 + 1)
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await nc.close()


async def test_broker_killed_and_restarted_service_goes_on(
    nats_server: EmbeddedBroker, nc: Client, js: JetStreamContext, clock: Clock
) -> None:
    s = full_cluster()
    failed(s)
    async with running(nats_server.url, holder="p1", clock=clock) as (svc, _):
        n = await publish(js, s)
        await until(lambda: acked_through(js, n))
        nats_server.kill()
        nats_server.start()
        await until(
            lambda: all(c.stats["reconnects"] >= 1 and c.is_connected for c in (nc, svc.nc)),
            within=20,
        )
        second = failed(s, "chat2")
        n = await publish(js, s, since=n)
        # The new trigger is decided (a consumer restored by a restarted server may report
        # nothing pending a moment before it delivers), then everything is acked.
        await until(lambda: svc.stats.decided == 2, within=30)
        await until(lambda: acked_through(js, n), within=20)
    log = await stored(js)
    decided = [x.event for x in of_type(log, ev.PreemptionDecidedEvent)]
    assert decided[-1].causation == second.id
    drained = [x.event.data.replica for x in of_type(log, ev.ReplicaDrainEvent)]  # type: ignore[union-attr]
    assert drained == ["b1", "b2", "b3", "b4"]
