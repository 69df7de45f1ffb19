"""`llmgw status` beside a live plane shows the log's health: the projector's lag and the
dead letters per consumer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.up_process import UpProcess

pytestmark = pytest.mark.timeout(90)

RAW_PUBLISH = (
    "import asyncio, nats, sys\n"
    "async def main():\n"
    "    nc = await nats.connect(sys.argv[1])\n"
    "    await nc.jetstream().publish('llmgw.catalog.scale.m', b'{not json')\n"
    "    await nc.close()\n"
    "asyncio.run(main())\n"
)


def test_status_shows_projector_lag_and_dead_letters(tmp_path: Path) -> None:
    up = UpProcess(tmp_path / "data", tmp_path / "up.log")
    try:
        url = up.wait_url()
        ok = up.llmgw("events", "publish", "quota.set", "--data", '{"owners": []}')
        assert ok.returncode == 0, ok.stderr
        # An event the contract refuses, sent raw: the projector dead-letters it.
        raw = subprocess.run(
            [sys.executable, "-c", RAW_PUBLISH, url], capture_output=True, text=True, timeout=30
        )
        assert raw.returncode == 0, raw.stderr
        deadline = time.monotonic() + 30
        while True:
            out = up.llmgw("status", "-o", "json")
            assert out.returncode == 0, out.stderr
            h = json.loads(out.stdout)["log"]
            if h["dead_letters"].get("projector") == 1 and h["projector"]["lag_events"] == 0:
                break
            assert time.monotonic() < deadline, h
            time.sleep(0.2)
        assert h["last_seq"] >= 2 and h["projector"]["seq"] == h["last_seq"]
        table = up.llmgw("status")
        line = next(x for x in table.stdout.splitlines() if x.startswith("LOG  seq"))
        assert "projector at" in line and "projector 1" in line, line
    finally:
        assert up.stop() == 0, up.text()
