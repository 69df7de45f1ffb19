"""`llmgw status` beside a live plane shows the log's health: the projector's lag and the
dead letters per consumer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(90)


def _llmgw(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_status_shows_projector_lag_and_dead_letters(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_NATS"}
    env["LLMGW_DATA"] = str(data)
    log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", "0"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (data / "nats.url").exists():
            assert up.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        bad = _llmgw(
            "events",
            "publish",
            "quota.set",
            "--data",
            '{"owners": []}',
            env=env,
        )
        assert bad.returncode == 0, bad.stderr
        # An event the contract refuses, sent raw: the projector dead-letters it.
        raw = subprocess.run(
            [
                sys.executable,
                "-c",
                "import asyncio, nats, sys\n"
                "async def main():\n"
                "    nc = await nats.connect(sys.argv[1])\n"
                "    js = nc.jetstream()\n"
                "    await js.publish('llmgw.catalog.scale.m', b'{not json')\n"
                "    await nc.close()\n"
                "asyncio.run(main())\n",
                (data / "nats.url").read_text().strip(),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert raw.returncode == 0, raw.stderr
        deadline = time.monotonic() + 30
        while True:
            out = _llmgw("status", "-o", "json", env=env)
            assert out.returncode == 0, out.stderr
            doc = json.loads(out.stdout)
            h = doc["log"]
            if h["dead_letters"].get("projector") == 1 and h["projector"]["lag_events"] == 0:
                break
            assert time.monotonic() < deadline, h
            time.sleep(0.2)
        assert h["last_seq"] >= 2 and h["projector"]["seq"] == h["last_seq"]
        table = _llmgw("status", env=env)
        line = next(x for x in table.stdout.splitlines() if x.startswith("LOG  seq"))
        assert "projector at" in line and "projector 1" in line, line
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        log.close()
