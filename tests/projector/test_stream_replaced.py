"""A view never reads on in a stream that is not the one it was folded from: a stream
deleted and created again (by a stray `$JS.API.STREAM.DELETE`, or an `up` pointed at
another cluster) makes the projector say so in one line and rebuild from the new log."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.js.client import JetStreamContext

from schemas import events as ev
from schemas import subjects
from services.bus import Publisher, ensure_streams, follow
from services.plane.follower import ViewFollower
from services.projector.service import Projector

pytestmark = pytest.mark.timeout(60)


def _scale(model: str, n: int, i: int) -> ev.Event:
    return ev.make(
        ev.ScaleDesired(model=model, replicas=n),
        id=f"{model}-{i}",
        time=datetime(2026, 11, 30, tzinfo=UTC),
        source="test",
    )


async def _fold(js: JetStreamContext, db: Path, upto: int) -> Projector:
    stop = asyncio.Event()
    p = Projector(js, db)
    task = asyncio.create_task(p.run(stop))
    try:
        await p.wait_for(upto, timeout=20)
    finally:
        stop.set()
        await task
    return p


async def test_a_replaced_stream_is_noticed_at_start_and_the_view_rebuilt(
    js: JetStreamContext, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await ensure_streams(js)
    pub = Publisher(js)
    for i in range(5):
        await pub.publish(_scale("old", i + 1, i))
    p = await _fold(js, tmp_path / "v.sqlite", 5)
    assert p.view.state.desired == {"old": 5}

    await js.delete_stream(subjects.STREAM)
    await ensure_streams(js)
    for i in range(2):
        await pub.publish(_scale("new", 7, i))
    caplog.set_level(logging.INFO, "llmgw")
    p = await _fold(js, tmp_path / "v.sqlite", 2)
    assert p.view.state.desired == {"new": 7}
    assert p.view.state.seq == 2
    said = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
    assert len(said) == 1 and "not the one the view was folded from" in said[0]


async def test_a_stream_replaced_under_a_running_projector_is_rebuilt_from(
    js: JetStreamContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A quiet reader notices within one origin check; a short one keeps the test short.
    monkeypatch.setattr(follow, "ORIGIN_CHECK_S", 0.2)
    await ensure_streams(js)
    pub = Publisher(js)
    for i in range(3):
        await pub.publish(_scale("old", i + 1, i))
    stop = asyncio.Event()
    p = Projector(js, tmp_path / "v.sqlite")
    task = asyncio.create_task(p.run(stop))
    try:
        await p.wait_for(3, timeout=20)
        await js.delete_stream(subjects.STREAM)
        await ensure_streams(js)
        await pub.publish(_scale("new", 9, 0))
        async with asyncio.timeout(30):
            # Polls the view another task rebuilds; its position goes back to 0 on the way.
            while p.view.state.desired != {"new": 9}:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task
    assert p.view.state.seq == 1


async def test_a_follower_rebuilds_its_view_from_a_replaced_stream(
    js: JetStreamContext, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduler's and the preemption service's view (ViewFollower) does as the
    projector does: one line, then the new log from its start; it does not stop, which
    would take the service (and `llmgw up`) down with it."""
    monkeypatch.setattr(follow, "ORIGIN_CHECK_S", 0.2)
    caplog.set_level(logging.INFO, "llmgw")
    await ensure_streams(js)
    pub = Publisher(js)
    for i in range(3):
        await pub.publish(_scale("old", i + 1, i))
    f = ViewFollower(js, consumer="test")
    f.start()
    try:
        await f.wait_for(3, timeout=20)
        await js.delete_stream(subjects.STREAM)
        await ensure_streams(js)
        await pub.publish(_scale("new", 9, 0))
        async with asyncio.timeout(30):
            while f.view.state.desired != {"new": 9}:
                assert f.error is None, f.error
                await asyncio.sleep(0.05)
    finally:
        await f.stop()
    assert f.error is None
    assert f.view.state.seq == 1 and f.replaced == 1
    said = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
    assert len(said) == 1 and "follower test" in said[0]
