"""The view is disposable: a `view.sqlite` that cannot be opened or read is moved aside
and folded again from the log (the newest snapshot, then the tail), and `up` serves on
and stops cleanly; a file that is not a database leaks no thread that would keep a
process from exiting."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import aiosqlite
import pytest

from schemas import events as ev
from services.bus import Publisher
from services.core.view import digest
from services.projector import store
from services.replay import rebuild
from services.up import Running, UpOptions, run
from tests.up_process import UpProcess

pytestmark = pytest.mark.timeout(60)

# STOP_BOUND_S is how long `up` may take to stop once asked, here where nothing is busy.
STOP_BOUND_S = 10.0


def _truncated(v: Path) -> None:
    with v.open("r+b") as f:
        f.truncate(v.stat().st_size // 3)


def _zeroed_header(v: Path) -> None:
    with v.open("r+b") as f:
        f.write(b"\0" * 100)


def _garbage_mid_file(v: Path) -> None:
    with v.open("r+b") as f:
        f.seek(4096)
        f.write(os.urandom(8192))


def _garbage_wal_and_shm(v: Path) -> None:
    v.with_name(v.name + "-wal").write_bytes(os.urandom(40_000))
    v.with_name(v.name + "-shm").write_bytes(os.urandom(32_768))


def _a_directory(v: Path) -> None:
    v.unlink()
    (v / "x").mkdir(parents=True)


def _a_schema_from_elsewhere(v: Path) -> None:
    v.unlink()
    c = sqlite3.connect(v)
    c.executescript(
        "CREATE TABLE position (x); CREATE TABLE nodes (y); INSERT INTO nodes VALUES (1);"
    )
    c.commit()
    c.close()


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "truncated": _truncated,
    "zeroed header": _zeroed_header,
    "garbage mid-file": _garbage_mid_file,
    "garbage WAL and SHM": _garbage_wal_and_shm,
    "a directory": _a_directory,
    "a schema from elsewhere": _a_schema_from_elsewhere,
}


def _event(data: ev.Data) -> ev.Event:
    from services.clock import new_id

    now = datetime.now(UTC)
    return ev.make(data, id=new_id(now), time=now, source="test/operator")


def _model(name: str) -> ev.ModelDeclared:
    return ev.ModelDeclared(
        name=name, cls="standard", min=0, max=4, profiles=(ev.ProfileSpec(name="tp1", gpus=1),)
    )


async def _stored_view_digest(db_path: Path) -> tuple[int, str]:
    async with aiosqlite.connect(f"file:{db_path}?mode=ro", uri=True) as db:
        v = await store.load_view(db)
    return v.state.seq, digest(v.state)


class Plane:
    """One in-process `llmgw up` on `data`, no simulated nodes and no dashboard."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.stop = asyncio.Event()
        self.task: asyncio.Task[int] | None = None
        self.running: Running | None = None

    async def __aenter__(self) -> Running:
        ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(
            run(UpOptions(data=self.data), self.stop, on_ready=ready.set_result)
        )
        done, _ = await asyncio.wait([ready, self.task], timeout=20, return_when="FIRST_COMPLETED")
        assert ready in done, self.task.result() if self.task in done else "up did not start"
        self.running = ready.result()
        return self.running

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.stop.set()
        assert await asyncio.wait_for(self.task, STOP_BOUND_S) == 0


async def _caught_up(running: Running) -> int:
    """The stream's last sequence, once the projector has committed it."""
    p = running.projector
    assert p is not None
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        last = (await p.js.stream_info("LLMGW")).state.last_seq
        if p.committed >= last:
            return last
        assert asyncio.get_running_loop().time() < deadline, (p.committed, last, p.error)
        await asyncio.sleep(0.02)


async def test_each_unreadable_view_is_moved_aside_and_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "llmgw")
    data = tmp_path / "data"
    db_path = data / "view.sqlite"
    async with Plane(data) as r:
        assert r.projector is not None
        pub = Publisher(r.projector.js)
        await pub.publish(_event(_model("before")))
        await _caught_up(r)
        await r.projector.snapshot()
        await pub.publish(_event(_model("after")))
        await _caught_up(r)

    for n, (kind, corrupt) in enumerate(CORRUPTIONS.items()):
        corrupt(db_path)
        caplog.clear()
        async with Plane(data) as r:
            assert r.projector is not None
            pub = Publisher(r.projector.js)
            # It serves: what is published now is folded into the rebuilt view.
            await pub.publish(_event(_model(f"m{n}")))
            last = await _caught_up(r)
            seq, got = await _stored_view_digest(db_path)
            assert seq == last, kind
            want = await rebuild.from_stream(r.projector.js, until_seq=last, use_snapshot=False)
            assert got == digest(want.view.state), kind
            assert f"m{n}" in want.view.state.models
        lines = [x.getMessage() for x in caplog.records if x.name == "llmgw.projector"]
        moved = [x for x in lines if "cannot be read" in x]
        if kind == "garbage WAL and SHM":
            # SQLite checks every WAL frame's checksum: a WAL of noise is ignored, and the
            # view as committed is read on.
            assert not moved, lines
            continue
        assert len(moved) == 1, (kind, lines)
        assert f"the view {db_path} cannot be read" in moved[0], moved
        assert "moved it aside to view.sqlite.corrupt-" in moved[0], moved
        assert any("started from the snapshot" in x for x in lines), (kind, lines)
    asides = sorted(p.name for p in data.glob("view.sqlite.corrupt-*") if "-wal" not in p.name)
    assert len([a for a in asides if not a.endswith("-shm")]) == len(CORRUPTIONS) - 1, asides
    # Nothing of the database's threads outlives the runs.
    assert not [t for t in threading.enumerate() if "connection_worker" in t.name and t.is_alive()]


async def test_a_file_that_is_not_a_database_leaks_no_thread(tmp_path: Path) -> None:
    """The hang on exit: a connection that opened and failed on its first statement was
    never closed, and its (non-daemon) thread kept the process alive for good."""
    v = tmp_path / "view.sqlite"
    v.write_bytes(b"\0" * 8192)
    before = set(threading.enumerate())
    with pytest.raises(sqlite3.DatabaseError) as e:
        await store.open_db(v)
    assert store.unreadable(e.value)
    deadline = asyncio.get_running_loop().time() + 5
    while True:
        left = [t for t in set(threading.enumerate()) - before if t.is_alive() and not t.daemon]
        if not left:
            break
        assert asyncio.get_running_loop().time() < deadline, left
        await asyncio.sleep(0.02)


def _mount_tmpfs(where: Path) -> bool:
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
        capture_output=True,
        timeout=10,
    )
    return got.returncode == 0


def _umount(where: Path) -> None:
    subprocess.run(["umount", str(where)], capture_output=True, timeout=10)


def test_up_stops_within_a_bound_on_sigterm(tmp_path: Path) -> None:
    """A real `up` on a view of zeroes rebuilds it, serves, and stops on SIGTERM with 0."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "view.sqlite").write_bytes(b"\0" * 8192)
    up = UpProcess(data, tmp_path / "up.log", "--no-ui")
    try:
        up.wait_url()
        deadline = time.monotonic() + 20
        while "projector: view at 0, reading on" not in up.text():
            assert up.alive() and time.monotonic() < deadline, up.text()[-2000:]
            time.sleep(0.05)
        assert "moved it aside" in up.text()
        asked = time.monotonic()
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(STOP_BOUND_S) == 0, up.text()[-2000:]
        assert time.monotonic() - asked < STOP_BOUND_S
    finally:
        up.stop()


async def test_up_exits_1_by_itself_on_a_fatal_fault(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A view that cannot even be moved aside (a mount point stands in its place) is a
    fault `up` cannot mend: it says so in one line and returns 1, within a bound, and no
    thread of its outlives it."""
    data = tmp_path / "data"
    v = data / "view.sqlite"
    v.mkdir(parents=True)
    if not _mount_tmpfs(v):
        pytest.skip("cannot mount a tmpfs here (not root): the fatal fault needs a mount point")
    try:
        code = await asyncio.wait_for(run(UpOptions(data=data), asyncio.Event()), STOP_BOUND_S)
        assert code == 1
        said = [x.getMessage() for x in caplog.records if "stopped unexpectedly" in x.getMessage()]
        assert len(said) == 1 and f"cannot move the unreadable view {v} aside" in said[0], said
    finally:
        _umount(v)
