"""A disk that fills and is freed again: `up` names the storage error in one line (cause
and store), and once the space is back it restarts its broker on the same store, so the
plane leads and decides again without a restart by hand. The disk is a tmpfs mounted for
the test (root only), as small as the streams allow: JetStream refuses a stream whose
limit (the dead letters' 1 GiB) exceeds 75% of the disk's free space at its start."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import nats
import pytest

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


def test_a_full_then_freed_disk_leaves_a_plane_that_decides(tmp_path: Path) -> None:
    fs = tmp_path / "fs"
    fs.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1600m", "tmpfs", str(fs)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (root only): {mounted.stderr.decode().strip()}")
    up: UpProcess | None = None
    try:
        data = fs / "data"
        up = UpProcess(data, tmp_path / "up.log", "--simulate", "1x2xH100-80GB", "--no-ui", *FAST)
        url = up.wait_url()
        _until("both lead", lambda: up.text().count(": leading") >= 2, up, 20)  # type: ignore[union-attr]
        declared = up.llmgw(
            "events",
            "publish",
            "model.declared",
            "--data",
            '{"name": "m", "min": 0, "profiles": [{"name": "tp1", "gpus": 1}]}',
        )
        assert declared.returncode == 0, declared.stderr

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

        def scaled() -> bool:
            return up.llmgw("scale", "m", "1").returncode == 0  # type: ignore[union-attr]

        def ready() -> bool:
            got = up.llmgw("status", "-o", "json")  # type: ignore[union-attr]
            if got.returncode != 0:
                return False
            doc = json.loads(got.stdout)
            m = next(x for x in doc["models"] if x["model"] == "m")
            return m["states"] == {"ready": 1}

        _until("scale accepted", scaled, up, WITHIN_S)
        _until("m ready: the plane decided", ready, up, WITHIN_S - (time.monotonic() - freed))
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
