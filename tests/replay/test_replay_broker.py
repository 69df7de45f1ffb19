"""Replay and subscribe against a real broker: the live log and its exported bundle give
the same view, snapshots only shorten the fold, and a follower whose start was purged
is told to re-list."""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path
from typing import Any

import pytest

from schemas import codec, subjects
from services import cli
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams, snapshots
from services.projector import store
from services.replay import rebuild
from services.replay.errors import Relist
from services.replay.subscribe import LIST, subscribe
from tests.replay.conftest import cluster, preemption_story
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(40)


async def publish(js: Any, s: Scenario) -> None:
    await ensure_streams(js)
    items = [(subj, codec.encode(e), e.id) for _, subj, e in s.events()]
    acks = await Publisher(js).publish_many(items)
    assert [a.seq for a in acks] == [q for q, _, _ in s.events()]


async def load_digest_and_dump(path: Path) -> tuple[str, str]:
    from services.core.view import digest

    db = await store.open_db(path)
    try:
        return digest((await store.load_view(db)).state), await store.dump(db)
    finally:
        await db.close()


def test_replay_from_jetstream_equals_replay_of_the_exported_bundle(
    nats_server: EmbeddedBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s, _ = preemption_story()

    async def setup() -> None:
        nc = await connect(nats_server.url, "test")
        try:
            await publish(nc.jetstream(), s)
        finally:
            await nc.close()

    asyncio.run(setup())
    url = ["--nats", nats_server.url]
    bundle = tmp_path / "export.jsonl"
    assert cli.main(["events", "export", "--out", str(bundle), *url]) == 0
    live, offline = tmp_path / "live.sqlite", tmp_path / "offline.sqlite"
    capsys.readouterr()
    assert cli.main(["replay", "--db", str(live), *url]) == 0
    out_live = capsys.readouterr().out
    assert cli.main(["replay", "--log", str(bundle), "--db", str(offline)]) == 0
    out_offline = capsys.readouterr().out
    # What was folded, not how long it took: "...; in 0.2s" is the machine's, not the log's.
    tail = lambda out: re.sub(r"; in [0-9.]+s", "", out.split(": ", 1)[1].split("; wrote")[0])  # noqa: E731
    assert tail(out_live) == tail(out_offline)
    assert f"reached seq {len(s.events())}" in out_live
    a, b = asyncio.run(load_digest_and_dump(live)), asyncio.run(load_digest_and_dump(offline))
    assert a == b
    # A moment in the middle agrees too, and so does explain from the broker.
    for db, extra in ((live, url), (offline, ["--log", str(bundle)])):
        assert cli.main(["replay", "--until-seq", "20", "--db", str(db), "--force", *extra]) == 0
    assert asyncio.run(load_digest_and_dump(live)) == asyncio.run(load_digest_and_dump(offline))
    capsys.readouterr()
    assert cli.main(["explain", "replica", "l1", *url]) == 0
    assert "tier 2: lower class above its minimum" in capsys.readouterr().out


async def test_replay_starts_from_the_newest_snapshot_at_or_before_the_target(
    js: Any, tmp_path: Path
) -> None:
    s = cluster()
    await publish(js, s)
    whole = await rebuild.from_stream(js, use_snapshot=False)
    at8 = await rebuild.from_stream(js, until_seq=8, use_snapshot=False)
    await snapshots.save(js, at8.view.state)
    via = await rebuild.from_stream(js)
    assert via.started_at == 8
    assert via.folded == len(s.events()) - 8
    assert "from the snapshot at seq 8" in via.summary()
    from services.core.view import digest

    assert digest(via.view.state) == digest(whole.view.state)
    # A target before the snapshot folds from the start.
    early = await rebuild.from_stream(js, until_seq=5)
    assert early.started_at == 0 and early.seq == 5


async def _next(it: Any, wait_s: float = 5.0) -> Any:
    return await asyncio.wait_for(it.__anext__(), wait_s)


async def test_subscribe_lists_then_yields_each_change_and_follows_the_tail(js: Any) -> None:
    s = cluster()
    await publish(js, s)
    n = len(s.events())
    it = subscribe(js, 12)
    try:
        seq, listing = await _next(it)
        assert (seq, listing.type) == (11, LIST)
        assert {"replica/l1", "replica/l2", "node/n1", "model/lab"} <= listing.keys
        seen = []
        for _ in range(12, n + 1):
            seq, ch = await _next(it)
            seen.append((seq, ch.type, ch.keys))
        assert [q for q, _, _ in seen] == list(range(12, n + 1))
        assert (12, "scale.desired", frozenset({"model/lab"})) in seen
        assert (n, "node.cordoned", frozenset({"node/n2"})) in seen
        # Live: an event published now arrives as a change, with the entity as it is now.
        s.at("+1m")
        s.state("l1", "draining")
        _, subj, e = s.events()[-1]
        await Publisher(js).publish_raw(subj, codec.encode(e), e.id)
        seq, ch = await _next(it)
        assert seq == n + 1
        assert ch.type == "replica.state" and ch.rejected is None
        assert ch.entities()["replica/l1"]["state"] == "draining"
    finally:
        await it.aclose()


async def test_subscribe_says_relist_when_from_seq_was_purged(js: Any) -> None:
    s = cluster()
    await publish(js, s)
    await js.purge_stream(subjects.STREAM, seq=6)
    with pytest.raises(Relist) as e:
        await _next(subscribe(js, 3))
    assert (e.value.from_seq, e.value.first_seq) == (3, 6)
    assert "older than the stream's first message" in str(e.value)
    # With no snapshot behind the purge point the view cannot be rebuilt at all: still a
    # Relist, saying why, never a silently partial view.
    with pytest.raises(Relist, match="no snapshot covers it"):
        await _next(subscribe(js, None))


async def test_subscribe_after_a_purge_lists_from_a_snapshot(js: Any) -> None:
    s = cluster()
    await publish(js, s)
    at10 = await rebuild.from_stream(js, until_seq=10, use_snapshot=False)
    await snapshots.save(js, at10.view.state)
    await js.purge_stream(subjects.STREAM, seq=11)
    it = subscribe(js, 12)
    try:
        seq, listing = await _next(it)
        assert (seq, listing.type) == (11, LIST)
        seq, ch = await _next(it)
        assert (seq, ch.type) == (12, "scale.desired")
    finally:
        with contextlib.suppress(Exception):
            await it.aclose()


def test_snapshot_on_demand_and_listed(nats_server, capsys) -> None:  # type: ignore[no-untyped-def]
    import asyncio as _asyncio

    from services import cli as _cli
    from services.bus import Publisher, connect, ensure_streams
    from tests.scenario import Scenario

    s = Scenario()
    s.node("n1", "8xH100-80GB")
    s.model("m", profiles=["tp1:1"])
    s.replica("r1", "m", on=("n1", [0]), ready="-1h")

    async def publish() -> None:
        nc = await connect(nats_server.url, "t")
        try:
            js = nc.jetstream()
            await ensure_streams(js)
            pub = Publisher(js)
            for _, subject, e in s.events():
                await pub.publish(e, subject=subject)
        finally:
            await nc.close()

    _asyncio.run(publish())
    assert _cli.main(["--nats", nats_server.url, "snapshot"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("saved view-s") and f"seq {len(s.events())}" in out
    assert _cli.main(["--nats", nats_server.url, "snapshot", "--list"]) == 0
    listed = capsys.readouterr().out
    assert f"seq {len(s.events()):>10,}" in listed
