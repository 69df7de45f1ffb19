"""The dashboard stays correct across a broker restart and a replaced log (the case
where the projector rebuilds): a client either keeps getting every change in order, or
is told to re-list and then lists the new truth."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from schemas import subjects
from services.bus import EmbeddedBroker, ensure_streams
from services.bus import follow as bus_follow
from tests.dashboard.http import Events, get
from tests.dashboard.test_dashboard_api import scale, serving, until

pytestmark = pytest.mark.timeout(90)


async def test_a_broker_restart_is_ridden_through(js: Any, nats_server: EmbeddedBroker) -> None:
    await ensure_streams(js)
    await scale(js, "m", 1)
    async with serving(js) as d:
        stream = await Events.open(d.url + "api/events")
        try:
            listed = await stream.next()
            assert listed.event == "list"
            nats_server.kill()
            nats_server.start()
            # Published once the client reconnected; the dashboard's follow loop reads on.
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                try:
                    seq = await scale(js, "m", 2)
                    break
                except Exception:
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.1)
            while True:
                f = await asyncio.wait_for(stream.next(), 30)
                if f.event == "relist":
                    # Allowed: then the listing is the truth.
                    stream.close()
                    stream = await Events.open(d.url + "api/events")
                    f = await stream.next()
                    assert f.event == "list" and f.id is not None and f.id >= seq
                    break
                if f.event == "change" and f.id == seq:
                    assert f.data["type"] == "scale.desired" and "replicas=2" in f.data["summary"]
                    break
        finally:
            stream.close()
        view = (await get(d.url + "api/view")).json()
        assert view["seq"] == seq


async def test_a_replaced_log_makes_every_client_relist(
    js: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bus_follow, "ORIGIN_CHECK_S", 0.2)
    await ensure_streams(js)
    for i in range(5):
        await scale(js, "old", i + 1)
    async with serving(js) as d:
        await until("the hub at the head", lambda: d.hub.seq == 5)
        stream = await Events.open(d.url + "api/events")
        try:
            assert (await stream.next()).event == "list"
            await js.delete_stream(subjects.STREAM)
            await ensure_streams(js)
            await scale(js, "new", 9)
            f = await asyncio.wait_for(stream.next(), 30)
            while f.event == "summary":
                f = await asyncio.wait_for(stream.next(), 30)
            assert f.event == "relist"
        finally:
            stream.close()
        await until(
            "the new log listed",
            lambda: d.hub.view is not None and d.hub.seq == 1,
            within=30,
        )
        fresh = await Events.open(d.url + "api/events")
        try:
            f = await fresh.next()
            assert f.event == "list" and f.id == 1
            assert f.data["seq"] == 1 and f.data["recent"][-1]["summary"] == "replicas=9"
        finally:
            fresh.close()
        view = (await get(d.url + "api/view")).json()
        assert view["seq"] == 1


async def test_a_stopping_hub_ends_a_follower_that_lost_its_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancellation swallowed inside the follower (as the NATS client does in places)
    must not keep the hub, and `llmgw dashboard` with it, from stopping."""
    from services.dashboard.hub import Hub

    started = asyncio.Event()
    cancels = 0

    async def follow_that_swallows_one(self: Hub) -> None:
        nonlocal cancels
        started.set()
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:
                    raise
                # The first one is lost, as `except CancelledError: pass` loses it.

    monkeypatch.setattr(Hub, "_follow", follow_that_swallows_one)
    hub = Hub(None)
    stop = asyncio.Event()
    task = asyncio.create_task(hub.run(stop))
    await asyncio.wait_for(started.wait(), 5)
    stop.set()
    await asyncio.wait([task], timeout=3)
    try:
        assert task.done(), "the hub did not stop: its follower never ended"
        assert cancels == 2
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
