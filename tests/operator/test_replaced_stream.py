"""A running `llmgw up` whose log is deleted and created again (a stray
`$JS.API.STREAM.DELETE`, a broker's store wiped under it) keeps running: the projector,
the scheduler's view and the preemption service's view each say in one line that the
stream is another, and rebuild from the new log. Nothing stops; the plane reads on."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.up_process import FAST, UpProcess

pytestmark = pytest.mark.timeout(120)

REPLACE = (
    "import asyncio, nats, sys\n"
    "from services.bus import ensure_streams\n"
    "async def main():\n"
    "    nc = await nats.connect(sys.argv[1])\n"
    "    js = nc.jetstream()\n"
    "    await js.delete_stream('LLMGW')\n"
    "    await ensure_streams(js)\n"
    "    await nc.close()\n"
    "asyncio.run(main())\n"
)


def _status(up: UpProcess) -> dict:  # type: ignore[type-arg]
    out = up.llmgw("status", "-o", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_up_rebuilds_its_views_from_a_replaced_stream_and_keeps_running(tmp_path: Path) -> None:
    up = UpProcess(tmp_path / "data", tmp_path / "up.log", "--simulate", "1x8xH100-80GB", *FAST)
    try:
        url = up.wait_url()
        for _ in range(3):
            ok = up.llmgw("events", "publish", "quota.set", "--data", '{"owners": []}')
            assert ok.returncode == 0, ok.stderr
        deadline = time.monotonic() + 30
        while (h := _status(up)["log"])["projector"]["lag_events"] or h["last_seq"] < 3:
            assert time.monotonic() < deadline, h
            time.sleep(0.2)
        old_seq = h["last_seq"]

        replaced = subprocess.run(
            [sys.executable, "-c", REPLACE, url], capture_output=True, text=True, timeout=30
        )
        assert replaced.returncode == 0, replaced.stderr
        ok = up.llmgw("events", "publish", "quota.set", "--data", '{"owners": []}')
        assert ok.returncode == 0, ok.stderr

        # Every reader of the log says it, once, and reads the new log from its start.
        deadline = time.monotonic() + 60
        while up.text().count("rebuilding the view from the new log") < 3:
            assert up.alive(), up.text()[-3000:]
            assert time.monotonic() < deadline, up.text()[-3000:]
            time.sleep(0.2)
        while True:
            h = _status(up)["log"]
            if h["projector"]["seq"] == h["last_seq"] and h["last_seq"] < old_seq + 1:
                break
            assert time.monotonic() < deadline, h
            time.sleep(0.2)
        assert up.alive(), up.text()[-3000:]
        text = up.text()
        for who in ("projector:", "follower scheduler", "follower preemption"):
            assert any(
                who in line and "rebuilding the view" in line for line in text.splitlines()
            ), (who, text[-3000:])
        # A stream that is gone is said once per reader, not on every retry.
        assert text.count("stream not found") <= 6, text[-3000:]
    finally:
        assert up.stop() == 0, up.text()[-3000:]
    text = up.text()
    assert "Traceback" not in text and "stopped unexpectedly" not in text, text[-3000:]
