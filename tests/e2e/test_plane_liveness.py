"""A dead control plane looks dead: after kill -9 of `llmgw up` its orphan broker still
answers and its log still says every node is ready, but `status` heads its output with
why the plane is not running and exits 1, its `-o json` says `running: false`, and
`scale` says no scheduler leads. While it runs, `status` names the leaders, the
projector's last commit and each node's heartbeat, and exits 0. `status --watch`, left
open on a terminal, shows the same and says PLANE NOT RUNNING within two heartbeat
periods of the kill, though the log stands still."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from services.bus import broker
from tests.up_process import FAST, UpProcess

pytestmark = pytest.mark.timeout(60)


def test_status_says_a_killed_plane_is_not_running(tmp_path: Path) -> None:
    data = tmp_path / "data"
    up = UpProcess(data, tmp_path / "up.log", "--simulate", "1x2xH100-80GB", "--no-ui", *FAST)
    orphan: int | None = None
    try:
        up.wait_url()
        deadline = time.monotonic() + 20
        while True:
            got = up.llmgw("status", "-o", "json")
            doc = json.loads(got.stdout) if got.stdout else {}
            plane = doc.get("plane") or {}
            heard = [n.get("heartbeat_age_s") is not None for n in doc.get("nodes", [])]
            if got.returncode == 0 and plane.get("running") and heard and all(heard):
                break
            assert time.monotonic() < deadline, (got.returncode, got.stdout[-2000:], got.stderr)
            time.sleep(0.2)
        leads = plane["leaders"]
        assert leads["scheduler"]["holder"].endswith("-scheduler") and leads["scheduler"]["since"]
        assert leads["preemption"]["live"] is True
        assert plane["projector"]["commit_age_s"] is not None and plane["up"]["running"] is True
        orphan = int((data / broker.PID_FILE).read_text().split()[0])
        os.kill(up.proc.pid, signal.SIGKILL)
        up.proc.wait(10)

        dead = up.llmgw("status")
        assert dead.returncode == 1, (dead.stdout, dead.stderr)
        first = dead.stdout.splitlines()[0]
        assert first.startswith(f"PLANE NOT RUNNING: llmgw up is not running on {data}"), first
        # The orphan broker answers: the log's own picture is still there, every node ready.
        assert "sim-0  ready" in dead.stdout and "none heard" in dead.stdout, dead.stdout
        assert "HEARTBEAT" in dead.stdout
        js = up.llmgw("status", "-o", "json")
        assert js.returncode == 1
        plane = json.loads(js.stdout)["plane"]
        assert plane["running"] is False and plane["up"]["running"] is False, plane
        assert "llmgw up is not running" in plane["problems"][0]

        scaled = up.llmgw("scale", "m", "1", "--force")
        assert scaled.returncode == 0, scaled.stderr
        warned = [x for x in scaled.stderr.splitlines() if "warning" in x]
        assert len(warned) == 1, scaled.stderr
        assert f"llmgw up is not running on {data}" in warned[0], warned
    finally:
        up.stop()
        if orphan is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(orphan, signal.SIGTERM)


# HEARTBEAT_S is the simulated agents' heartbeat period in the watch test: the screen
# must say the plane is dead within two of them.
HEARTBEAT_S = 1.0
CLEAR = "\x1b[H\x1b[2J"


class _Screen:
    """`llmgw status --watch` on a pseudo-terminal, as an operator leaves it open: each
    drawing clears the screen, so the output splits into frames at the clear."""

    def __init__(self, up: UpProcess) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "status", "--watch"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=up.env,
            start_new_session=True,
        )
        os.close(slave)
        self.out = ""

    def frames(self) -> list[str]:
        """Every frame drawn so far: the last one too once it ends a line and nothing
        more is there to read (each drawing is written and flushed at once)."""
        while select.select([self.master], [], [], 0.05)[0]:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                break
            if not chunk:
                break
            self.out += chunk.decode(errors="replace").replace("\r\n", "\n")
        parts = self.out.split(CLEAR)[1:]
        if parts and not parts[-1].endswith("\n"):
            parts.pop()
        return [f for f in parts if f.strip()]

    def until(self, what: str, cond: Any, within: float) -> tuple[str, float]:
        """The first new frame `cond` holds for, and when it was read (monotonic)."""
        seen = len(self.frames())
        deadline = time.monotonic() + within
        while True:
            frames = self.frames()
            for f in frames[seen:]:
                if cond(f):
                    return f, time.monotonic()
            seen = len(frames)
            assert self.proc.poll() is None, self.out[-3000:]
            assert time.monotonic() < deadline, f"no frame with {what}: {self.out[-3000:]}"

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        os.close(self.master)


def _seq(frame: str) -> str:
    return next(x for x in frame.splitlines() if ": seq " in x).split(", last event")[0]


def test_status_watch_says_a_killed_plane_is_not_running(tmp_path: Path) -> None:
    data = tmp_path / "data"
    up = UpProcess(
        data,
        tmp_path / "up.log",
        *("--simulate", "1x2xH100-80GB", "--no-ui", "--no-gateway", *FAST),
        *("--heartbeat", f"{HEARTBEAT_S:g}"),
    )
    screen: _Screen | None = None
    orphan: int | None = None
    try:
        up.wait_url()
        deadline = time.monotonic() + 30
        while up.text().count(": leading") < 2:
            assert time.monotonic() < deadline, up.text()[-3000:]
            time.sleep(0.05)
        screen = _Screen(up)

        # The same headline, LOG and PLANE lines and heartbeat ages as `status`.
        def whole(f: str) -> bool:
            return (
                "\nLOG  seq " in f
                and "\nPLANE  scheduler " in f
                and "HEARTBEAT" in f
                and re.search(r"sim-0\s+ready\s+0/2\s+0\s+[0-9.]+s ago", f) is not None
            )

        first, _ = screen.until("the LOG, PLANE lines and a heartbeat age", whole, 30)
        assert "PLANE NOT RUNNING" not in first, first
        # It redraws on a timer: frames come while the log stands still.
        same = [first]
        while len(same) < 3:
            f, _ = screen.until("another drawing", lambda f: True, 10 * HEARTBEAT_S)
            same = [*same, f] if _seq(f) == _seq(same[-1]) else [f]

        orphan = int((data / broker.PID_FILE).read_text().split()[0])
        os.kill(up.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        up.proc.wait(10)
        dead, at = screen.until(
            "PLANE NOT RUNNING", lambda f: "PLANE NOT RUNNING" in f, 10 * HEARTBEAT_S
        )
        assert at - killed <= 2 * HEARTBEAT_S, (at - killed, dead)
        assert dead.splitlines()[0].startswith(
            f"PLANE NOT RUNNING: llmgw up is not running on {data}"
        ), dead
        assert "HEARTBEAT" in dead and "\nLOG  seq " in dead, dead
    finally:
        if screen is not None:
            screen.close()
        up.stop()
        if orphan is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(orphan, signal.SIGTERM)
