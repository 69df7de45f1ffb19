"""`llmgw log compact --keep AGE`: the events stored longer ago than AGE go to the
archive and off the stream; those stored since stay. The cut falls where the server's
storage times say: the log here is published in two batches, and the command's clock
(not a sleep) is set to the second batch's storage time plus AGE."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from schemas import codec, subjects
from schemas import events as ev
from services import cli, clock
from services.bus import Publisher, consume, ensure_streams, snapshots
from services.core.view import SCHEMA, digest
from services.replay import archive, rebuild
from services.replay.source import LogSource
from tests.replay.conftest import preemption_story

pytestmark = pytest.mark.timeout(120)

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


async def test_compact_keep_cuts_at_the_storage_age(
    js: Any, nats_server: Any, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    await ensure_streams(js)
    s, _ = preemption_story()
    old = [(subject, codec.encode(e), e.id) for _, subject, e in s.events()]
    await Publisher(js).publish_many(old)
    n_old = len(old)
    for i in range(5):
        s.emit(ev.ScaleDesired(model="lab", replicas=i % 3))
    new = [(subject, codec.encode(e), e.id) for _, subject, e in s.events()[n_old:]]
    await Publisher(js).publish_many(new)
    info = await js.stream_info(subjects.STREAM)
    assert (info.state.first_seq, info.state.last_seq) == (1, n_old + 5)
    whole_before = await rebuild.from_stream(js, use_snapshot=False)

    where = tmp_path / "archive"
    base = ["--nats", nats_server.url, "log", "compact", "--yes", "--archive", str(where)]

    # An age that reaches back past the first event: nothing to compact.
    assert await asyncio.to_thread(cli.main, [*base, "--keep", "1d"]) == 0
    assert "nothing to compact" in capsys.readouterr().out
    assert archive.parts(where) == []

    # Two seconds after the second batch was stored, `--keep 2s` keeps just that batch:
    # the first is archived and purged, the second stays.
    async for batch in consume.read_range(js, n_old + 1, n_old + 1):
        # To the microsecond below (a datetime's resolution), so the cut is not past it.
        second_stored = EPOCH + timedelta(microseconds=batch[0].time_ns // 1000)
    monkeypatch.setattr(clock, "utc_now", lambda: second_stored + timedelta(seconds=2))
    assert await asyncio.to_thread(cli.main, [*base, "--keep", "2s"]) == 0
    out = capsys.readouterr().out
    assert "saved snapshot" in out and f"at seq {n_old}" in out, out
    assert f"archived seq 1..{n_old} ({n_old:,} events" in out, out
    assert f"the stream now starts at seq {n_old + 1}" in out, out
    info = await js.stream_info(subjects.STREAM)
    assert info.state.first_seq == n_old + 1
    assert info.state.last_seq >= n_old + 5
    assert info.state.messages == info.state.last_seq - n_old
    (part,) = archive.parts(where)
    assert (part.first, part.last) == (1, n_old) and archive.verify(part) == ""
    assert info.config.metadata[archive.METADATA_KEY] == str(where)
    assert n_old in [seq for schema, seq, _ in await snapshots.listing(js) if schema == SCHEMA]

    # Archive + stream read as one log: the same view as before the cut, no gap.
    whole = await rebuild.from_stream(js, until_seq=n_old + 5, use_snapshot=False)
    assert isinstance(whole.source, LogSource) and whole.source.stats.gaps == []
    assert digest(whole.view.state) == digest(whole_before.view.state)
