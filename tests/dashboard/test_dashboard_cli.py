"""`llmgw dashboard` as an operator runs it, and `llmgw up --no-ui`: real processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
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


def _listening(pid: int) -> set[int]:
    """The TCP ports process `pid` itself listens on (its own sockets, not its children's)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _up_until_started(
    data: Path, *args: str
) -> tuple[subprocess.Popen[str], list[str], Callable[[], None]]:
    """`llmgw up --port 0 ARGS`, read until it says everything is running; its lines so far."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(data),
        cwd=REPO,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()
    seen: list[str] = []

    def finish() -> None:
        """Ctrl-C; it exits 0 with no traceback in the rest of its output."""
        assert proc.stdout is not None
        try:
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
            pumping.join(10)
        finally:
            proc.stdout.close()
        while (line := lines.get_nowait() if not lines.empty() else None) is not None:
            seen.append(line)
        assert code == 0, "".join(seen)
        assert "Traceback" not in "".join(seen), "".join(seen)

    deadline = time.monotonic() + 30
    try:
        while not any("up: scheduler, preemption service" in x for x in seen):
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert line is not None, "".join(seen)
            seen.append(line)
    except BaseException:
        with contextlib.suppress(BaseException):
            finish()
        raise
    return proc, seen, finish


def test_up_prints_the_dashboard_url(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc, seen, finish = _up_until_started(data, "--ui-listen", "127.0.0.1:0")
    try:
        urls = [m.group(1) for x in seen if (m := re.search(r"dashboard: (http://\S+)$", x))]
        assert len(urls) == 1, seen
        (url,) = urls
        assert (data / "dashboard.url").read_text().strip() == url
        m = re.match(r"http://127\.0\.0\.1:(\d+)/$", url)
        assert m, url
        assert int(m.group(1)) in _listening(proc.pid)
        with urllib.request.urlopen(url + "api/health", timeout=10) as r:
            assert r.status == 200
    finally:
        finish()


def test_up_no_ui_serves_no_dashboard(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc, seen, finish = _up_until_started(data, "--no-ui", "--no-gateway")
    try:
        # Fully started (its services run, a command finds it), and no dashboard (nor
        # gateway) anywhere.
        status = subprocess.run(
            [sys.executable, "-m", "services.cli", "status"],
            capture_output=True,
            text=True,
            env=_env(data),
            cwd=REPO,
            timeout=30,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        assert (data / "nats.url").exists()
        assert not (data / "dashboard.url").exists()
        assert not any("dashboard:" in x or "gateway:" in x for x in seen), seen
        assert not (data / "gateway.url").exists()
        # The broker is a child process: `up` itself listens on nothing.
        assert _listening(proc.pid) == set()
    finally:
        finish()
