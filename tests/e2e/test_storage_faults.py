"""A disk that fills and is freed again: `up` names the storage error in one line (cause
and store), and once the space is back it restarts its broker on the same store, so the
plane leads and decides again without a restart by hand. The disk is a tmpfs mounted for
the test (root only), as small as the streams allow: JetStream refuses a stream whose
limit (the dead letters' 256 MiB) exceeds 75% of the disk's free space at its start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import nats
import pytest

from schemas import events as ev
from services.bus import Publisher
from services.bus.errors import PublishError
from services.clock import new_id
from services.replay import rebuild
from tests.up_process import FAST, UpProcess

pytestmark = pytest.mark.timeout(90)

# WITHIN_S is how soon after the space is back the plane must decide again.
WITHIN_S = 60.0


def _until(what: str, cond, up: UpProcess, within: float) -> float:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    while not cond():
        assert up.alive(), up.text()[-3000:]
        assert time.monotonic() - started < within, f"{what}\n{up.text()[-3000:]}"
        time.sleep(0.1)
    return time.monotonic() - started


def _fill(path: Path) -> None:
    """Write until the disk is full, to the last page."""
    with path.open("wb", buffering=0) as f:
        free = shutil.disk_usage(path.parent).free
        with contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), 0, max(free - (1 << 20), 1))
        f.seek(0, os.SEEK_END)
        for chunk in (1 << 16, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)


async def _fail_a_lease_write(url: str) -> None:
    """Write to the lease bucket until the full disk refuses it: what the leases' own
    renewals meet a little later, when their file next grows by a page."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for _ in range(200):
            try:
                await js.publish("$KV.llmgw_leases.filler", b"x" * 4096, timeout=1)
            except (nats.errors.Error, TimeoutError):
                return
    finally:
        await nc.close()


TP1 = (ev.ProfileSpec(name="tp1", gpus=1),)


async def _publish(url: str, data: ev.Data) -> None:
    nc = await nats.connect(url)
    try:
        now = datetime.now(UTC)
        await Publisher(nc.jetstream()).publish(
            ev.make(data, id=new_id(now), time=now, source="test/operator")
        )
    finally:
        await nc.close()


async def _decides(url: str, freed: float) -> float:
    """Scale `m` to 1 (retried while the broker comes back) and wait for its replica to be
    ready, as the log says; seconds from `freed`."""
    while True:
        try:
            await _publish(url, ev.ScaleDesired(model="m", replicas=1))
            break
        except (nats.errors.Error, TimeoutError, OSError, PublishError):
            assert time.monotonic() - freed < WITHIN_S, "the scale was never stored"
            await asyncio.sleep(0.2)
    # The broker may be restarted under this read (that is what the plane does once the
    # space is back): a read cut short is read again on a new connection.
    while True:
        try:
            nc = await nats.connect(url)
            try:
                view = (await rebuild.from_stream(nc.jetstream())).view
            finally:
                await nc.close()
            if any(r.state == "ready" for r in view.replicas_of("m")):
                return time.monotonic() - freed
        except (nats.errors.Error, TimeoutError, OSError):
            pass
        assert time.monotonic() - freed < WITHIN_S, "the plane did not decide"
        await asyncio.sleep(0.1)


def test_a_full_then_freed_disk_leaves_a_plane_that_decides(tmp_path: Path) -> None:
    fs = tmp_path / "fs"
    fs.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=500m", "tmpfs", str(fs)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (root only): {mounted.stderr.decode().strip()}")
    up: UpProcess | None = None
    try:
        data = fs / "data"
        up = UpProcess(data, tmp_path / "up.log", "--simulate", "1x2xH100-80GB", "--no-ui", *FAST)
        url = up.wait_url()
        _until("both lead", lambda: up.text().count(": leading") >= 2, up, 20)  # type: ignore[union-attr]
        asyncio.run(_publish(url, ev.ModelDeclared(name="m", cls="standard", min=0, profiles=TP1)))

        filler = fs / "filler"
        _fill(filler)
        asyncio.run(_fail_a_lease_write(url))
        store = data / "jetstream"
        said = f"broker: storage error in the store {store}"
        _until("the storage error said", lambda: said in up.text(), up, 20)  # type: ignore[union-attr]
        lines = [x for x in up.text().splitlines() if "storage error" in x]
        assert len(lines) == 1 and "no space left on device" in lines[0], lines

        # The leases cannot be renewed: the plane has no leader, and `up` waits for space
        # before it restarts its broker (a restart on a full disk would fail the same way).
        _until("the lease lost", lambda: "vm" in up.text() and "stands by" in up.text(), up, 20)  # type: ignore[union-attr]
        _until("waiting for space", lambda: "once it has space" in up.text(), up, 20)  # type: ignore[union-attr]
        assert "restarting nats-server on the same store" not in up.text()

        filler.unlink()
        freed = time.monotonic()

        took = asyncio.run(_decides(url, freed))
        assert took < WITHIN_S, took
        text = up.text()
        assert "restarting nats-server on the same store" in text, text[-3000:]
    finally:
        if up is not None:
            up.stop()
        subprocess.run(["umount", "-l", str(fs)], capture_output=True)


def test_a_storage_error_is_read_from_the_servers_log_line() -> None:
    from services.bus.broker import StorageFault, storage_fault

    line = (
        "[3284] 2026/12/02 13:30:46.869675 [ERR] JetStream failed to store a msg on stream "
        "'$G > KV_llmgw_leases': write /d/jetstream/$G/streams/KV_llmgw_leases/msgs/1.blk: "
        "no space left on device"
    )
    assert storage_fault(line) == StorageFault(
        "no space left on device",
        "KV_llmgw_leases",
        "/d/jetstream/$G/streams/KV_llmgw_leases/msgs/1.blk",
    )
    assert storage_fault("[3284] 2026/12/02 13:30:46.869675 [INF] Server is ready") is None
