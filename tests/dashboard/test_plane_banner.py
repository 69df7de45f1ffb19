"""The plane's liveness on a real broker, as the dashboard's health (its banner) and
`llmgw status` read it: a broker with nobody leading is not a running plane, whatever its
log says; leaders are named with when their term began, which renewals keep."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from nats.js.client import JetStreamContext

from schemas import codec, subjects
from schemas import events as ev
from services.clock import new_id
from services.dashboard import health
from services.plane import liveness
from services.plane.lease import DEFAULT_BUCKET, Lease, decode_value
from services.projector import store

pytestmark = pytest.mark.timeout(30)

STATIC = Path(__file__).resolve().parents[2] / "services" / "dashboard" / "static"


async def test_nobody_leading_is_a_plane_not_running(js: JetStreamContext) -> None:
    got = await health.check(js, None)
    plane = got["plane"]
    assert plane["running"] is False
    assert plane["problems"] == ["no scheduler leads", "no preemption leads"]
    # The page shows it as a banner over everything else.
    page = (STATIC / "index.html").read_text()
    assert '<div id="banner" role="alert" hidden></div>' in page
    assert "plane.running" in (STATIC / "app.js").read_text()


async def test_leaders_are_named_with_their_term(js: JetStreamContext) -> None:
    began = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    wall = [began]
    leases = [
        Lease(js, name=f"llmgw.{role}", holder=f"h-{role}", ttl_s=30.0, wall=lambda: wall[0])
        for role in liveness.ROLES
    ]
    for x in leases:
        assert await x.acquire()
    wall[0] = began + timedelta(hours=1)
    for x in leases:
        assert await x.acquire()  # a renewal, an hour on: the same term
    kv = await js.key_value(DEFAULT_BUCKET)
    assert decode_value((await kv.get("llmgw.scheduler")).value) == ("h-scheduler", began)
    plane = (await health.check(js, None))["plane"]
    assert plane["running"] is True, plane
    lead = plane["leaders"]["scheduler"]
    assert lead["holder"] == "h-scheduler" and lead["since"] == "2026-01-02T03:04:05Z"
    assert lead["live"] is True and lead["renewed_s_ago"] < 5
    # An entry its holder stopped renewing (seen from later than two renewal periods)
    # is not a leader, though the server keeps it until its TTL.
    later = datetime.now(UTC) + timedelta(seconds=25)
    leads = await liveness.leaders(js, "llmgw", later)
    assert leads is not None and leads["scheduler"] is not None
    assert leads["scheduler"]["live"] is False
    await leases[0].release()
    assert (await liveness.leaders(js, "llmgw", datetime.now(UTC)))["scheduler"] is None  # type: ignore[index]


def test_an_older_holders_value_reads_as_a_term_of_unknown_start() -> None:
    assert decode_value(b"host-1-scheduler") == ("host-1-scheduler", None)
    assert decode_value(None) == (None, None)


async def test_a_projector_behind_the_log_that_stopped_committing_is_stale(
    js: JetStreamContext, tmp_path: Path
) -> None:
    db_path = tmp_path / "view.sqlite"
    db = await store.open_db(db_path)
    await db.close()
    # Its last commit a minute ago, and an event in the log since.
    old = time.time() - 60
    os.utime(db_path, (old, old))
    now = datetime.now(UTC)
    e = ev.make(ev.ScaleDesired(model="m", replicas=1), id=new_id(now), time=now, source="t")
    await js.publish(subjects.subject_for(e), codec.encode(e))
    plane = (await health.check(js, db_path))["plane"]
    p = plane["projector"]
    assert p["lag_events"] == 1 and p["commit_age_s"] >= 59 and p["stale"] is True, p
    assert any(x.startswith("the projector is stale (1 events behind") for x in plane["problems"])
    assert plane["running"] is False
