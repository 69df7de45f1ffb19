"""`llmgw log compact` on a 200,000-event log: the events before the cut go to a
compressed, checksummed archive and off the stream; a replay from snapshot + archive +
stream still gives the live projector's view, digest for digest; `explain` still tells
a preemption that now lives only in the archive; and a missing archive is named as a gap.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from schemas import codec, subjects
from schemas import events as ev
from services import cli
from services.bus import Publisher, snapshots
from services.core import compaction
from services.core.view import digest
from services.projector import store
from services.projector.service import Projector
from services.replay import archive, rebuild
from services.replay.source import LogSource
from tests.replay.conftest import preemption_story

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

TOTAL = 200_000
CUT = 130_001
SNAPSHOT_EVERY = 50_000


@pytest.mark.parametrize(
    ("first", "last", "before", "snaps", "want"),
    [
        pytest.param(1, 100, 50, [60], compaction.Cut(1, 50, 60), id="a later snapshot covers"),
        pytest.param(1, 100, 50, [49], compaction.Cut(1, 50, 49), id="the one just before"),
        pytest.param(1, 100, 50, [10], compaction.Cut(1, 50, None), id="too early: take one"),
        pytest.param(1, 100, 500, [], compaction.Cut(1, 100, None), id="the last event stays"),
        pytest.param(40, 100, 40, [99], "nothing to compact", id="already compacted"),
        pytest.param(1, 0, 10, [], "empty", id="an empty log"),
    ],
)
def test_where_the_log_may_be_cut(
    first: int, last: int, before: int, snaps: list[int], want: compaction.Cut | str
) -> None:
    got = compaction.plan(first, last, before, snaps)
    if isinstance(want, str):
        assert isinstance(got, str) and want in got
    else:
        assert got == want


async def test_compacting_a_200k_event_log(js, nats_server, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    s, facts = preemption_story()
    victim = str(facts["victims"][0])  # type: ignore[index]
    for i in range(TOTAL - len(s.events())):
        s.emit(ev.ScaleDesired(model="lab", replicas=i % 3))
    items = [(subject, codec.encode(e), e.id) for _, subject, e in s.events()]
    await Publisher(js).publish_many(items, window=5000)
    info = await js.stream_info(subjects.STREAM)
    assert info.state.last_seq == TOTAL

    # The live view: the projector's, with its snapshots every 50,000 events.
    db_path = tmp_path / "view.sqlite"
    projector = Projector(js, db_path, snapshot_every=SNAPSHOT_EVERY)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    await projector.wait_for(TOTAL, timeout=120)
    # The projector records its digests on the log as it goes: read to the very end.
    end = 0
    while end != (end := (await js.stream_info(subjects.STREAM)).state.last_seq):
        await projector.wait_for(end, timeout=30)
    stop.set()
    await asyncio.wait_for(task, 30)
    db = await store.open_db(db_path)
    try:
        live = await store.load_view(db)
    finally:
        await db.close()
    assert live.seq == end > TOTAL
    assert [seq for _, seq, _ in await snapshots.listing(js)][:3] == [50_000, 100_000, 150_000]
    at_140k = await rebuild.from_stream(js, until_seq=140_000, use_snapshot=False)

    where = tmp_path / "archive"
    argv = ["--nats", nats_server.url, "log", "compact", "--yes", "--before", str(CUT)]
    assert await asyncio.to_thread(cli.main, [*argv, "--archive", str(where)]) == 0
    out = capsys.readouterr().out
    assert "snapshot at seq 150000 covers the cut" in out
    assert f"the stream now starts at seq {CUT}" in out
    info = await js.stream_info(subjects.STREAM)
    assert (info.state.first_seq, info.state.last_seq) == (CUT, end)
    (part,) = archive.parts(where)
    assert (part.first, part.last) == (1, CUT - 1) and archive.verify(part) == ""
    assert info.config.metadata[archive.METADATA_KEY] == str(where)

    # Archive + stream, from the start: the live view.
    whole = await rebuild.from_stream(js, use_snapshot=False)
    assert isinstance(whole.source, LogSource) and whole.source.stats.gaps == []
    assert whole.seq == end and digest(whole.view.state) == digest(live.state)
    # Snapshot (100,000) + archive (to 130,000) + stream: the view at 140,000.
    mid = await rebuild.from_stream(js, until_seq=140_000)
    assert mid.started_at == 100_000 and mid.folded == 40_000
    assert digest(mid.view.state) == digest(at_140k.view.state)

    # The decision now lives only in the archive; explain still tells it.
    code = await asyncio.to_thread(
        cli.main, ["--nats", nats_server.url, "explain", "replica", victim]
    )
    out = capsys.readouterr().out
    assert code == 0 and "crit" in out and "preempt" in out, out

    # Compacting again at the same cut has nothing to do.
    assert await asyncio.to_thread(cli.main, argv) == 0
    assert "nothing to compact: the stream starts at seq 130001" in capsys.readouterr().out

    # Without its archive, the log has a gap, and the replay names it.
    shutil.move(where, tmp_path / "elsewhere")
    gapped = await rebuild.from_stream(js, use_snapshot=False)
    assert gapped.source.stats.gaps == [(1, CUT - 1)]
    assert "seqs 1-130000 missing" in gapped.source.stats.gap_summary()
    code = await asyncio.to_thread(
        cli.main, ["--nats", nats_server.url, "history", "replica", victim]
    )
    assert "seqs 1-130000 missing (130,000 events)" in capsys.readouterr().err
