"""The view's disk fills while the log grows: the projector says so once, keeps running,
and once space is back folds on from its last commit to the log's end; `up` is not
stopped for it. The disk is a small tmpfs mounted for the test (root only)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import aiosqlite
import pytest
from nats.js.client import JetStreamContext

from schemas import events as ev
from services.bus import Publisher
from services.clock import new_id
from services.core.view import digest
from services.projector import store
from services.projector.service import Projector
from services.replay import rebuild

pytestmark = pytest.mark.timeout(30)


def _mount(where: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], capture_output=True
    )


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(path: Path) -> None:
    with path.open("wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), 0, max(shutil.disk_usage(path.parent).free, 1))
        f.seek(0, os.SEEK_END)
        for chunk in (4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)


def _model(n: int) -> ev.Event:
    now = datetime.now(UTC)
    data = ev.ModelDeclared(
        name=f"m{n}",
        cls="standard",
        min=0,
        max=4,
        profiles=(ev.ProfileSpec(name="tp1", gpus=1),),
        aliases=tuple(f"m{n}-alias-{i}-{'x' * 40}" for i in range(8)),
    )
    return ev.make(data, id=new_id(now), time=now, source="test/operator")


async def _until(what: str, cond, within: float = 15) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + within
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.02)


async def test_a_full_disk_under_the_view_stops_nothing(
    js: JetStreamContext, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "llmgw.projector")
    fs = tmp_path / "fs"
    fs.mkdir()
    mounted = await asyncio.to_thread(_mount, fs)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (root only): {mounted.stderr.decode().strip()}")
    try:
        db_path = fs / "view.sqlite"
        p = Projector(js, db_path)
        stop = asyncio.Event()
        task = asyncio.create_task(p.run(stop))
        pub = Publisher(js)
        first = await pub.publish(_model(0))
        await p.wait_for(first.seq, 10)

        await asyncio.to_thread(_fill, fs / "filler")
        last = 0
        for n in range(1, 400):
            last = (await pub.publish(_model(n))).seq
            if any("cannot be written" in r.getMessage() for r in caplog.records):
                break
        said = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
        assert len(said) == 1 and f"the view {db_path} cannot be written" in said[0], said
        assert not task.done()

        (fs / "filler").unlink()
        await p.wait_for(last, 15)
        assert any("the view is written again" in r.getMessage() for r in caplog.records)
        stop.set()
        await asyncio.wait_for(task, 10)
        async with aiosqlite.connect(f"file:{db_path}?mode=ro", uri=True) as db:
            got = await store.load_view(db)
        want = await rebuild.from_stream(js, until_seq=last, use_snapshot=False)
        assert got.state.seq == last and digest(got.state) == digest(want.view.state)
    finally:
        await asyncio.to_thread(_umount, fs)
