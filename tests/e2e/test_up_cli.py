"""`llmgw up` as an operator runs it: a real process, found by other commands through its
data directory, stopped cleanly by Ctrl-C."""

from __future__ import annotations

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


def test_up_is_found_beside_it_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_NATS"}
    env["LLMGW_DATA"] = str(data)
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--port",
            "0",
            "--simulate",
            "1x8xH100-80GB",
            "--load-delay",
            "0.05",
            "--start-delay",
            "0.01",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while not (data / "nats.url").exists():
            assert up.poll() is None, up.stdout.read() if up.stdout else ""
            assert time.monotonic() < deadline, "llmgw up recorded no broker URL"
            time.sleep(0.05)
        # Every other command finds the broker through the data directory alone.
        spec = tmp_path / "c.yaml"
        spec.write_text("models:\n  - {name: m, min: 2, profiles: [{name: tp1, gpus: 1}]}\n")
        applied = _llmgw("apply", "-f", str(spec), env=env)
        assert applied.returncode == 0, applied.stderr
        deadline = time.monotonic() + 30
        while True:
            out = _llmgw("status", env=env)
            line = next((x for x in out.stdout.splitlines() if x.strip().startswith("m ")), "")
            # Exit 0 once the plane leads; before its leases are taken status exits 1.
            if out.returncode == 0 and "2/2" in line and "ready:2" in line:
                break
            assert time.monotonic() < deadline, out.stdout + out.stderr
            time.sleep(0.2)
        # A second `llmgw up` on the same data directory is refused in one line.
        second = _llmgw("up", "--port", "0", env=env)
        assert second.returncode == 1 and "already serves" in second.stderr
        assert second.stderr.count("\n") == 1
    finally:
        up.send_signal(signal.SIGINT)
        try:
            log, _ = up.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert up.returncode == 0, log
    assert "Traceback" not in log, log
    assert "up: stopping" in log and "broker: stopped" in log
    assert not (data / "nats.url").exists(), "a clean stop forgets the broker URL"
    # With nothing running, a command reads the stored log and says so in one line.
    # The plane is not running, and status exits 1 for it, its output headed by why.
    after = _llmgw("status", env=env)
    assert after.returncode == 1 and "llmgw up is not running" in after.stderr
    assert after.stdout.startswith("PLANE NOT RUNNING: llmgw up is not running on ")
    assert after.stderr.count("\n") == 1
