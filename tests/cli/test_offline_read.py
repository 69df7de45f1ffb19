"""Reading a stopped control plane: `status`, `view`, `history`, `explain`, `events
export` and `events tail --since` on the data directory of an `llmgw up` that was
stopped, from its stored log, saying so in one line; and every read command on a copy
of that directory mounted read-only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
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


def _run_up_and_stop(
    tmp_path: Path,
    data: Path,
    env: dict[str, str],
    while_running: Callable[[UpProcess], None] | None = None,
) -> None:
    """`up` on `data` until model m is 2/2 ready, then `while_running(up)`, then Ctrl-C."""
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
        if while_running is not None:
            while_running(up)
    finally:
        code = up.stop()
    assert code == 0, up.text()


def test_a_stopped_plane_is_read_from_its_stored_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    env = _env(data)
    running = tmp_path / "running.jsonl"

    def export(up: UpProcess) -> None:
        got = up.llmgw("events", "export", "-o", str(running))
        assert got.returncode == 0, got.stderr

    _run_up_and_stop(tmp_path, data, env, while_running=export)
    assert not (data / "nats.url").exists()
    note = NOTE.format(data)

    # Read an hour later (the command's clock, not a sleep): the plane's last event is an
    # hour old, and status counts from the wall clock, not from that event.
    later = clock.utc_now() + timedelta(hours=1)
    monkeypatch.setattr(clock, "utc_now", lambda: later)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # A stopped plane is not running: said first, and the exit status says it too.
    assert main(["status"]) == 1
    out, err = capsys.readouterr()
    assert err == note
    headline, first = out.splitlines()[:2]
    assert headline == f"PLANE NOT RUNNING: llmgw up is not running on {data}", headline
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

    # Stopped: export and tail --since read its stored log, as view does.
    stopped = tmp_path / "stopped.jsonl"
    assert main(["events", "export", "-o", str(stopped)]) == 0
    out, err = capsys.readouterr()
    assert err == note and out.startswith("exported ")
    assert stopped.read_bytes() == running.read_bytes()
    assert main(["events", "tail", "--since", "1", "-o", "json"]) == 0
    out, err = capsys.readouterr()
    assert err == note
    assert out.encode() == running.read_bytes()
    # Without --since a tail waits for what a live plane stores next: there is none.
    assert main(["events", "tail"]) == 1
    assert "start one with `llmgw up`" in capsys.readouterr().err

    # A copy of the directory on a read-only mount (a bind mount of its own, in a
    # mount namespace of the command's own, so nothing leaks if it is killed).
    assert shutil.which("unshare") and os.geteuid() == 0, "a read-only mount takes root"
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    before = sorted((str(p), p.stat().st_mtime_ns) for p in copy.rglob("*"))
    results = tmp_path / "results.json"
    script = (
        f"mount --bind -o ro {copy} {copy} && exec {sys.executable} -c '{_READ_ALL}' "
        f"{copy} {results} {tmp_path} '{json.dumps(READS)}'"
    )
    got = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert got.returncode == 0, got.stderr
    (_, _, wrote, _), *reads = json.loads(results.read_text())
    assert wrote == "Read-only file system"
    ro_note = (
        f"llmgw: llmgw up is not running on {copy}; read from its stored log "
        f"(a copy: {copy} is read-only)\n"
    )
    for argv, code, out, err in reads:
        assert err.startswith(ro_note), (argv, err)
        assert "Traceback" not in err and "internal error" not in err, (argv, err)
        if argv != ["status"]:  # status says how the plane is; its exit code says so too
            assert code == 0, (argv, err)
        assert out, argv
    assert (tmp_path / "read-only.jsonl").read_bytes() == running.read_bytes()
    assert sorted((str(p), p.stat().st_mtime_ns) for p in copy.rglob("*")) == before


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


# _READ_ALL runs every read command on the data directory argv[1] (mounted read-only
# around it), after checking that a write there fails, even for root; the results go
# to argv[2] as JSON: [argv, exit code, stdout, stderr] each.
_READ_ALL = """
import contextlib, io, json, os, sys
from pathlib import Path
from services.cli import main
data, out, tmp = sys.argv[1:4]
try:
    Path(data, "probe").write_text("x")
    wrote = "written"
except OSError as e:
    wrote = e.strerror
os.environ["LLMGW_DATA"] = data
results = [["probe", 0, wrote, ""]]
for argv in json.loads(sys.argv[4]):
    argv = [a.replace("{tmp}", tmp) for a in argv]
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        code = main(argv)
    results.append([argv, code, o.getvalue(), e.getvalue()])
Path(out).write_text(json.dumps(results))
"""

READS = [
    ["status"],
    ["view"],
    ["history", "model", "m"],
    ["explain", "model", "m"],
    ["diff", "--seq", "1", "--seq", "3"],
    ["replay", "--db", "{tmp}/view.sqlite"],
    ["preemption", "plan", "--model", "m"],
    ["events", "export", "-o", "{tmp}/read-only.jsonl"],
    ["events", "tail", "--since", "1", "-o", "json"],
    ["snapshot", "--list"],
]
