"""Reading a stopped control plane: `status`, `view`, `history` and `explain` on the data
directory of an `llmgw up` that was stopped, from its stored log, saying so in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from services import clock
from services.bus import broker
from services.cli import main
from tests.up_process import FAST, UpProcess, env_for, llmgw

pytestmark = pytest.mark.timeout(120)

NOTE = "llmgw: llmgw up is not running on {}; read from its stored log\n"


def _llmgw(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return llmgw(*args, env=env)


def _env(data: Path) -> dict[str, str]:
    return env_for(data)


def _run_up_and_stop(tmp_path: Path, data: Path, env: dict[str, str]) -> None:
    up = UpProcess(data, tmp_path / "up.log", "--simulate", "1x8xH100-80GB", *FAST)
    try:
        up.wait_url()
        spec = tmp_path / "c.yaml"
        spec.write_text("models:\n  - {name: m, min: 2, profiles: [{name: tp1, gpus: 1}]}\n")
        applied = up.llmgw("apply", "-f", str(spec))
        assert applied.returncode == 0, applied.stderr
        deadline = time.monotonic() + 30
        while True:
            out = up.llmgw("status")
            assert out.returncode == 0, out.stderr
            line = next((x for x in out.stdout.splitlines() if x.strip().startswith("m ")), "")
            if "2/2" in line and "ready:2" in line:
                break
            assert time.monotonic() < deadline, out.stdout
            time.sleep(0.2)
    finally:
        code = up.stop()
    assert code == 0, up.text()


def test_a_stopped_plane_is_read_from_its_stored_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    env = _env(data)
    _run_up_and_stop(tmp_path, data, env)
    assert not (data / "nats.url").exists()
    note = NOTE.format(data)

    # Read an hour later (the command's clock, not a sleep): the plane's last event is an
    # hour old, and status counts from the wall clock, not from that event.
    later = clock.utc_now() + timedelta(hours=1)
    monkeypatch.setattr(clock, "utc_now", lambda: later)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["status"]) == 0
    out, err = capsys.readouterr()
    assert err == note
    first = out.splitlines()[0]
    assert "last event now" not in first and ("60m ago" in first or "1h ago" in first), out
    assert any(x.strip().startswith("m ") and "2/2" in x for x in out.splitlines())

    view = _llmgw("view", env=env)
    assert view.returncode == 0, view.stderr
    assert view.stderr == note
    assert f"the stored log in {data}" in view.stdout
    assert "live 2/2" in view.stdout

    hist = _llmgw("history", "model", "m", env=env)
    assert hist.returncode == 0, hist.stderr
    assert hist.stderr == note
    assert "model.declared" in hist.stdout

    why = _llmgw("explain", "model", "m", env=env)
    assert why.returncode == 0, why.stderr
    assert why.stderr == note
    assert why.stdout.startswith("model m (")
    assert "live 2 of 2 desired" in why.stdout

    # It leaves the directory as it found it: no URL, no broker, the lock free.
    assert not (data / "nats.url").exists()
    assert not (data / broker.PID_FILE).exists()
    fd = broker.lock_data_dir(data)
    assert fd is not None
    os.close(fd)


def test_an_empty_data_directory_still_says_start_llmgw_up(tmp_path: Path) -> None:
    data = tmp_path / "empty"
    data.mkdir()
    for argv in (("status",), ("view",), ("explain", "model", "m")):
        got = _llmgw(*argv, env=_env(data))
        assert got.returncode == 1, got.stdout
        assert "start one with `llmgw up`" in got.stderr
        assert got.stderr.count("\n") == 1
        assert "Traceback" not in got.stderr


def test_a_live_up_holding_the_lock_is_not_shared(tmp_path: Path) -> None:
    """A stale URL while another process holds the lock: the stored log is that
    process's, so the command keeps the one-line error rather than reading under it."""
    data = tmp_path / "data"
    (data / broker.STORE_DIR / "x").mkdir(parents=True)
    (data / broker.STORE_DIR / "x" / "f").write_bytes(b"x")
    broker.write_url(data, f"nats://127.0.0.1:{broker.free_port()}")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from services.bus import broker; "
            f"fd = broker.lock_data_dir(Path({str(data)!r})); print(fd is not None, flush=True); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "True"
        got = _llmgw("status", env=_env(data))
        assert got.returncode == 1
        assert "no broker answers" in got.stderr and got.stderr.count("\n") == 1
    finally:
        holder.communicate(timeout=10)
