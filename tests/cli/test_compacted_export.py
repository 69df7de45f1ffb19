"""`events export` of a compacted log: the bundle holds the archive's events too and
replays to the live view's digest; without the archive it starts from the stored
snapshot that covers the stream's start; with neither it is refused, naming the seqs
(`--allow-gaps` exports what there is). A bundle cut after compaction without its
archive is refused by the readers in one line, and `--allow-gaps` reads past it."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from schemas import bundle, codec, subjects
from schemas import events as ev
from services import cli
from services.bus import Publisher, ensure_streams, snapshots
from services.core.view import digest
from services.replay import rebuild
from tests.replay.conftest import preemption_story

pytestmark = pytest.mark.timeout(60)


def _main(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_a_compacted_log_exports_whole_or_from_its_snapshot(
    js: Any, nats_server: Any, tmp_path: Path, capsys: Any
) -> None:
    await ensure_streams(js)
    s, _ = preemption_story()
    for i in range(50):
        s.emit(ev.ScaleDesired(model="lab", replicas=i % 3))
    await Publisher(js).publish_many([(sub, codec.encode(e), e.id) for _, sub, e in s.events()])
    last = int((await js.stream_info(subjects.STREAM)).state.last_seq)
    live = digest((await rebuild.from_stream(js, use_snapshot=False)).view.state)
    cut = last - 20
    where = tmp_path / "archive"
    url = ["--nats", nats_server.url]
    code, out, err = await asyncio.to_thread(
        _main,
        capsys,
        *url,
        "log",
        "compact",
        "--yes",
        "--before",
        str(cut),
        "--archive",
        str(where),
    )
    assert code == 0, err

    # The archive is where the stream says: the bundle holds all of it, from seq 1.
    whole = tmp_path / "whole.jsonl"
    code, out, err = await asyncio.to_thread(
        _main, capsys, *url, "events", "export", "-o", str(whole)
    )
    assert code == 0, err
    assert f"exported {last} events (seq 1..{last}), seq 1..{cut - 1} from the archive" in out
    assert next(bundle.read(str(whole))).seq == 1
    assert digest((await rebuild.from_bundle(str(whole))).view.state) == live

    # The same log cut where the stream starts now: a hole at its start, refused.
    lines = whole.read_bytes().splitlines(keepends=True)
    hole = tmp_path / "cut.jsonl"
    hole.write_bytes(b"".join(lines[cut - 1 :]))
    code, out, err = await asyncio.to_thread(_main, capsys, "view", "--log", str(hole))
    assert code == 1 and out == ""
    assert err == (
        f"llmgw: {hole}:1: the bundle starts at seq {cut}: seqs 1-{cut - 1} are missing and "
        "no snapshot in it covers them (a compacted log exported or cut without its "
        "archive, or a hand-cut file); --allow-gaps replays past it\n"
    )
    code, out, err = await asyncio.to_thread(
        _main, capsys, "view", "--log", str(hole), "--allow-gaps"
    )
    assert code == 0 and f"seqs 1-{cut - 1} missing ({cut - 1} events)" in err, err

    # The archive gone: the bundle starts from the snapshot compaction made sure of.
    shutil.move(where, tmp_path / "elsewhere")
    from_snap = tmp_path / "from-snapshot.jsonl"
    code, out, err = await asyncio.to_thread(
        _main, capsys, *url, "events", "export", "-o", str(from_snap)
    )
    assert code == 0, err
    assert err == (
        f"llmgw: note: seqs 1-{cut - 1} are not on the stream and the archive {where} does "
        f"not hold them: the bundle starts from the stored snapshot of seq {cut - 1}\n"
    )
    assert f"(seq {cut}..{last}) after a snapshot of seq {cut - 1}" in out
    assert digest((await rebuild.from_bundle(str(from_snap))).view.state) == live

    # Neither archive nor snapshot: refused, naming the seqs, unless --allow-gaps.
    await js.delete_object_store(snapshots.BUCKET)
    gapped = tmp_path / "gapped.jsonl"
    export = [*url, "events", "export", "-o", str(gapped)]
    code, out, err = await asyncio.to_thread(_main, capsys, *export)
    assert code == 1 and not gapped.exists()
    assert err == (
        f"llmgw: seqs 1-{cut - 1} are not on the stream, the archive {where} does not hold "
        "them, and no stored snapshot covers them: a bundle without them would replay "
        "wrong; --allow-gaps exports what there is\n"
    )
    code, out, err = await asyncio.to_thread(_main, capsys, *export, "--allow-gaps")
    assert code == 0 and f"(seq {cut}..{last})" in out, err
    assert gapped.read_bytes() == hole.read_bytes()
    # Past the end there is nothing to export, and nothing to cover.
    past = [*url, "events", "export", "-o", str(tmp_path / "past.jsonl")]
    code, out, err = await asyncio.to_thread(_main, capsys, *past, "--from-seq", str(last + 5))
    assert code == 0 and out.startswith("exported 0 events to "), err
