"""A dead control plane looks dead: after kill -9 of `llmgw up` its orphan broker still
answers and its log still says every node is ready, but `status` heads its output with
why the plane is not running and exits 1, its `-o json` says `running: false`, and
`scale` says no scheduler leads. While it runs, `status` names the leaders, the
projector's last commit and each node's heartbeat, and exits 0."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

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
