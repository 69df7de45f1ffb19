"""`llmgw simulate --jobs`: the policies run side by side in processes, with the same
report and bundles as one after another, one line for a failure, and no process left
behind, whether the runs end, fail or are stopped by a signal."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.cli import app
from services.sim import runs
from services.sim import scenario as scn

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = str(ROOT / "deploy/examples/sim/multi-tenant.yaml")


# SIMULATING_CPU_S is the CPU time past which a worker is simulating: its start (the
# interpreter, its imports, the scenario) takes well under it.
SIMULATING_CPU_S = 1.0


def _cpu_s(pid: int) -> float:
    """The CPU time (user and system) process `pid` has used; 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    utime, stime = stat.rsplit(")", 1)[1].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def _procs() -> list[tuple[int, str, int, int, str]]:
    """Every process: pid, state, parent, process group and command line."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        state, ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        out.append((int(d), state, int(ppid), int(pgrp), cmd))
    return out


def _sigint_held(pid: int) -> bool:
    """Whether the process has SIGINT blocked or ignored (True once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return True
    masks = dict(line.split(":\t") for line in status if line.startswith(("SigBlk", "SigIgn")))
    bit = 1 << (signal.SIGINT - 1)
    return bool((int(masks["SigBlk"], 16) | int(masks["SigIgn"], 16)) & bit)


def _no_workers_left() -> None:
    assert multiprocessing.active_children() == []
    workers = [p for p in _procs() if p[2] == os.getpid() and "spawn_main" in p[4]]
    assert workers == []


def _simulate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = app.main(["simulate", SCENARIO, "--duration", "3h", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_two_jobs_give_the_report_and_bundles_of_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reports = {}
    for jobs in ("1", "2"):
        out_dir = tmp_path / jobs
        code, out, err = _simulate(capsys, "--jobs", jobs, "--out", str(out_dir), "--json")
        assert code == 0, err
        reports[jobs] = json.loads(out)
        _no_workers_left()
    for r in reports.values():
        assert r.pop("wall_s").keys() == {"reference", "node-aware"}
    assert reports["1"] == reports["2"]
    names = sorted(p.name for p in (tmp_path / "1").iterdir())
    assert names == ["multi-tenant-node-aware.jsonl", "multi-tenant-reference.jsonl"]
    for name in names:
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes()


def test_the_table_says_what_ran_in_parallel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _simulate(capsys, "--jobs", "2", "--out", str(tmp_path))
    assert code == 0, err
    wrote = [line for line in out.splitlines() if line.startswith("wrote ")]
    assert [line.split()[1] for line in wrote] == [
        str(tmp_path / "multi-tenant-reference.jsonl"),
        str(tmp_path / "multi-tenant-node-aware.jsonl"),
    ]
    lines = err.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["reference", "node-aware"]
    assert lines[2].startswith("2 policies in 2 processes: ") and lines[2].endswith(" in all")
    code, out, err = _simulate(capsys, "--jobs", "1")
    assert code == 0 and len(err.splitlines()) == 2 and "processes" not in err


def test_workers_send_back_results_without_their_views() -> None:
    sc = scn.load(SCENARIO)
    pols = ["node-aware", "reference"]
    apart = runs.run(sc, pols, duration_s=3 * 3600, jobs=2)
    here = runs.run(sc, pols, duration_s=3 * 3600, jobs=1)
    assert [r.policy for r in apart] == pols == [r.policy for r in here]
    assert all(r.view is None for r in apart) and all(r.view is not None for r in here)
    assert [(r.digest, r.metrics) for r in apart] == [(r.digest, r.metrics) for r in here]
    _no_workers_left()


@pytest.mark.parametrize("jobs", ["0", "-2"])
def test_jobs_below_one_is_a_usage_error(capsys: pytest.CaptureFixture[str], jobs: str) -> None:
    code, out, err = _simulate(capsys, "--jobs", jobs)
    assert code == 2 and out == ""
    assert err == f"llmgw: --jobs {jobs}: expected 1 or more processes\n"


def test_a_failing_worker_is_one_line_and_stops_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The reference run cannot open its bundle (a directory has its name) and fails in its
    # process, while the node-aware run, a simulated year (tens of seconds), has only
    # begun: it is stopped, not waited for.
    (tmp_path / "multi-tenant-reference.jsonl").mkdir()
    t0 = time.monotonic()
    code, out, err = _simulate(capsys, "--jobs", "2", "--out", str(tmp_path), "--duration", "365d")
    assert code == 1 and out == ""
    assert err == f"llmgw: {tmp_path / 'multi-tenant-reference.jsonl'}: Is a directory\n"
    assert time.monotonic() - t0 < 10
    _no_workers_left()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize(
    ("sig", "group", "code"),
    [(signal.SIGINT, True, 130), (signal.SIGTERM, False, 143)],
    ids=["ctrl-c", "sigterm"],
)
def test_a_signal_stops_every_worker(
    tmp_path: Path, sig: signal.Signals, group: bool, code: int
) -> None:
    # Ctrl-C reaches the whole process group; SIGTERM usually the command alone.
    argv = [sys.executable, "-m", "services.cli", "simulate", SCENARIO, "--duration", "60d"]
    argv += ["--jobs", "2", "--out", str(tmp_path)]
    p = subprocess.Popen(
        argv,
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            workers = [x for x in _procs() if x[2] == p.pid and "spawn_main" in x[4]]
            # From its first moment (importing, before it can ignore SIGINT itself) a
            # worker has SIGINT blocked or ignored: a Ctrl-C is the parent's to act on.
            for pid, *_ in workers:
                assert _sigint_held(pid), f"worker {pid} is open to SIGINT"
            if len(workers) == 2 and all(x[1] != "Z" for x in workers):
                break
            time.sleep(0.005)
        else:
            pytest.fail("the two workers did not start")
        if group:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:  # the test failed: take its whole group down
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == code, err
    assert "Traceback" not in err and "wrote " not in out
    # What the command started (its workers and multiprocessing's helper) goes with it.
    deadline = time.monotonic() + 10
    while any(x[3] == p.pid and x[1] != "Z" for x in _procs()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [x for x in _procs() if x[3] == p.pid and x[1] != "Z"] == []


class _TwoArgs(Exception):
    """An exception that pickles and does not unpickle: its constructor takes two
    arguments, its `args` hold one."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")


def _failing_clock() -> float:
    raise _TwoArgs("the clock", "stopped")


def test_a_worker_s_exception_that_does_not_read_back_keeps_its_words() -> None:
    sc = scn.load(SCENARIO)
    with pytest.raises(RuntimeError, match=r"^_TwoArgs: the clock: stopped$"):
        runs.run(sc, ["reference", "node-aware"], duration_s=3600.0, jobs=2, clock=_failing_clock)
    _no_workers_left()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers die with it on Linux")
def test_workers_die_with_a_command_killed_outright() -> None:
    """The command killed with SIGKILL (or by the kernel for memory) stops no worker
    itself: the workers go with it rather than simulate a year no one will read."""
    argv = [sys.executable, "-m", "services.cli", "simulate", SCENARIO, "--duration", "365d"]
    p = subprocess.Popen(
        [*argv, "--jobs", "2"],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            workers = [x[0] for x in _procs() if x[2] == p.pid and "spawn_main" in x[4]]
            if len(workers) == 2:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the two workers did not start")
        # Killed while simulating: once each worker has run past what its start costs
        # (its imports take a fraction of a second of CPU), not once some time has passed.
        deadline = time.monotonic() + 60
        while min(_cpu_s(w) for w in workers) < SIMULATING_CPU_S:
            assert time.monotonic() < deadline, "the workers did not get to simulate"
            time.sleep(0.02)
        p.kill()
        p.wait(timeout=10)
        deadline = time.monotonic() + 10
        alive = workers
        while alive and time.monotonic() < deadline:
            alive = [x[0] for x in _procs() if x[0] in workers and x[1] != "Z"]
            time.sleep(0.05)
        assert alive == []
    finally:
        for x in _procs():
            if x[3] == p.pid and x[1] != "Z":
                os.kill(x[0], signal.SIGKILL)
