"""`llmgw log compact` under faults: a compaction killed while it writes its archive part
leaves `.writing-<pid>.jsonl.gz` behind, and the next run removes it (a live writer's
file is left alone); an archive disk that fills (a one-page tmpfs) is reported with the
path that could not be written, and nothing is purged."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from schemas import codec, subjects
from schemas import events as ev
from services import cli
from services.bus import Publisher, ensure_streams
from services.replay import archive
from tests.replay.conftest import preemption_story

pytestmark = pytest.mark.timeout(60)

# _WRITER starts an archive part, writes one line, says so and waits to be killed.
_WRITER = """
import sys, time
from pathlib import Path
from services.replay import archive
w = archive.Writer(Path(sys.argv[1]))
w.write(1, "llmgw.scale.m", b'{"x":1}')
print("writing", flush=True)
time.sleep(60)
"""


async def _log(js: Any, extra: int = 0) -> int:
    """The preemption story and `extra` scale events on the stream; its last seq."""
    await ensure_streams(js)
    s, _ = preemption_story()
    for i in range(extra):
        s.emit(ev.ScaleDesired(model="lab", replicas=i % 3))
    items = [(subject, codec.encode(e), e.id) for _, subject, e in s.events()]
    await Publisher(js).publish_many(items)
    return int((await js.stream_info(subjects.STREAM)).state.last_seq)


def _killed_writer(where: Path) -> Path:
    """The temporary file of a real writer killed with SIGKILL while it wrote."""
    p = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(where)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == "writing\n"
        tmp = where / f".writing-{p.pid}.jsonl.gz"
        assert tmp.exists()
        # Alive, its file is its own: a sweep leaves it.
        assert archive.sweep(where) == [] and tmp.exists()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        if p.stdout is not None:
            p.stdout.close()
    return tmp


async def test_the_next_compaction_removes_what_a_killed_one_left(
    js: Any, nats_server: Any, tmp_path: Path, capsys: Any
) -> None:
    last = await _log(js)
    where = tmp_path / "archive"
    where.mkdir()
    killed = _killed_writer(where)
    # A checksum's temporary file of a dead writer too (killed between the two renames).
    (where / f".writing-{os.getpid() + 100000}{archive.SUM_SUFFIX}").write_text("x\n")
    argv = ["--nats", nats_server.url, "log", "compact", "--yes", "--before", str(last)]
    assert await asyncio.to_thread(cli.main, [*argv, "--archive", str(where)]) == 0
    out = capsys.readouterr().out
    assert f"removed {killed}, left by a compaction that was stopped while writing" in out
    assert sorted(p.name for p in where.iterdir()) == [
        archive.part_name(1, last - 1),
        archive.part_name(1, last - 1) + archive.SUM_SUFFIX,
    ], out


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
async def test_a_full_archive_disk_is_named_and_nothing_is_purged(
    js: Any, nats_server: Any, tmp_path: Path
) -> None:
    assert os.geteuid() == 0, "mounting the tmpfs takes root"
    last = await _log(js, extra=3000)
    where = tmp_path / "small"
    where.mkdir()
    # A one-page tmpfs in a mount namespace of the command's own, gone when it exits.
    script = (
        f"mount -t tmpfs -o size=4k tmpfs {where} && exec {sys.executable} -m services.cli "
        f"--nats {nats_server.url} log compact --yes --before {last} --archive {where}/archive"
    )
    got = await asyncio.to_thread(
        subprocess.run,
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert got.returncode == 1, got.stdout + got.stderr
    line = (
        rf"llmgw: cannot write the archive file {re.escape(str(where))}/archive/"
        r"\.writing-\d+\.jsonl\.gz: No space left on device; nothing was purged\n"
    )
    assert re.fullmatch(line, got.stderr), got.stderr
    info = await js.stream_info(subjects.STREAM)
    assert info.state.first_seq == 1 and info.state.last_seq >= last
