"""`llmgw dashboard` as an operator runs it, and `llmgw up --no-ui`: real processes."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from services.bus import EmbeddedBroker, connect, ensure_streams

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


def _env(data: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LLMGW_NATS", "LLMGW_DATA")}
    env["LLMGW_DATA"] = str(data)
    return env


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return out


def test_dashboard_serves_any_broker_and_prints_its_url(
    nats_server: EmbeddedBroker, tmp_path: Path
) -> None:
    async def streams() -> None:
        nc = await connect(nats_server.url, "test")
        await ensure_streams(nc.jetstream())
        await nc.close()

    asyncio.run(streams())
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "services.cli", "--nats", nats_server.url, "dashboard"),
            *("--listen", "127.0.0.1:0", "--token", "t0k"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(tmp_path / "data"),
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"dashboard: (http://127\.0\.0\.1:\d+/)\?token=t0k$", line.strip())
        assert m, line
        url = m.group(1)
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(url + "api/health", timeout=10)
        assert denied.value.code == 401
        denied.value.close()
        deadline = time.monotonic() + 20
        while True:
            with urllib.request.urlopen(url + "api/health?token=t0k", timeout=10) as r:
                if b'"last_seq"' in r.read():
                    break
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        out = _stop(proc)
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out


def test_up_no_ui_serves_no_dashboard(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", "0", "--no-ui"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(data),
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 30
        while not (data / "nats.url").exists():
            assert proc.poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not (data / "dashboard.url").exists()
    finally:
        out = _stop(proc)
    assert proc.returncode == 0, out
    assert "dashboard:" not in out, out
