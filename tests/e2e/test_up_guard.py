"""`llmgw up` guards its broker: credentials only its user can read, a broker that dies
is restarted on the same store, and the orphan broker of a killed `up` is stopped by the
next one. Real processes, kill -9, no sleeping to let time pass (polls with deadlines)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.bus import broker as bus_broker
from services.bus.urls import public_url
from tests.up_process import FAST, UpProcess, env_for, llmgw

SIM = ("--simulate", "1x8xH100-80GB", *FAST)

pytestmark = pytest.mark.timeout(120)


def _env(data: Path) -> dict[str, str]:
    return env_for(data)


def _llmgw(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return llmgw(*args, env=env)


def _wait(cond: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    state = None
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        state = text[text.rfind(")") + 2]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def data(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "data"
    yield d
    # Whatever happened, no broker of this directory outlives the test.
    bus_broker.stop_orphan(d)


def _broker_pid(data: Path) -> int:
    return int((data / bus_broker.PID_FILE).read_text().split()[0])


def _model_ready(env: dict[str, str]) -> bool:
    out = _llmgw("status", env=env)
    return out.returncode == 0 and any(
        x.strip().startswith("m ") and "ready:1" in x for x in out.stdout.splitlines()
    )


def test_credentials_are_private_and_required(data: Path, tmp_path: Path) -> None:
    up = UpProcess(data, tmp_path / "up.log", *SIM)
    try:
        _wait(lambda: (data / "nats.url").exists(), "the broker URL")
        for name in ("nats.url", bus_broker.PASSWORD_FILE):
            mode = stat.S_IMODE((data / name).stat().st_mode)
            assert mode == 0o600, f"{name} is {oct(mode)}"
        url = bus_broker.read_url(data)
        assert url is not None and f"{bus_broker.USER}:" in url
        public = public_url(url)
        assert "@" not in public and bus_broker.password(data) not in up.text()
        # A client without the password (any other local user) is turned away.
        host, _, port = public.removeprefix("nats://").rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.recv(4096)  # INFO
            sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
            answer = sock.recv(4096)
        assert b"Authorization Violation" in answer, answer
        # Every command beside it connects through the recorded URL, and never prints it;
        # status exits 0 once the plane leads.
        _wait(lambda: up.text().count(": leading") >= 2, "both leaders")
        status = _llmgw("status", env=_env(data))
        assert status.returncode == 0, status.stderr
        assert bus_broker.password(data) not in status.stdout + status.stderr
    finally:
        up.stop()
    assert up.proc.returncode == 0, up.text()


def test_a_dead_broker_is_restarted_and_an_orphan_is_stopped(data: Path, tmp_path: Path) -> None:
    env = _env(data)
    first = UpProcess(data, tmp_path / "up1.log", *SIM)
    second: UpProcess | None = None
    try:
        _wait(lambda: (data / bus_broker.PID_FILE).exists(), "the broker's pid file")
        spec = tmp_path / "c.yaml"
        spec.write_text("models:\n  - {name: m, min: 1, profiles: [{name: tp1, gpus: 1}]}\n")
        assert _llmgw("apply", "-f", str(spec), env=env).returncode == 0
        _wait(lambda: _model_ready(env), "m ready")

        # kill -9 of the broker: `up` reaps it, restarts it on the same store, goes on.
        dead = _broker_pid(data)
        os.kill(dead, signal.SIGKILL)
        _wait(lambda: "broker: restarted" in first.text(), "the restart")
        assert not _alive(dead), "the dead broker is reaped, not left a zombie"
        assert first.proc.poll() is None
        _wait(lambda: _model_ready(env), "the view after the restart")

        # kill -9 of `up`: its broker lives on as an orphan...
        orphan = _broker_pid(data)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
        assert _alive(orphan)
        # ...until the next `up` on the directory finds it, stops it and starts its own.
        second = UpProcess(data, tmp_path / "up2.log", *SIM)
        _wait(lambda: "left running by an `llmgw up` that was killed" in second.text(), "orphan")
        _wait(lambda: not _alive(orphan), "the orphan to go")
        _wait(lambda: _model_ready(env), "the view under the second up")
        assert "Traceback" not in second.text()
    finally:
        if second is not None:
            second.stop()
        first.stop()
    assert second is not None and second.proc.returncode == 0, second.text()


def test_a_broker_that_cannot_be_restarted_stops_up_with_one_line(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services import up

    broker = bus_broker.EmbeddedBroker(data, auth=True)
    broker.start()
    try:
        broken = tmp_path / "nats-server"
        broken.write_text("#!/bin/sh\necho 'store is corrupt' >&2\nexit 3\n")
        broken.chmod(0o755)
        monkeypatch.setenv("LLMGW_NATS_SERVER", str(broken))
        os.kill(broker.pid or 0, signal.SIGKILL)

        async def watch() -> None:
            await asyncio.wait_for(up._watch_broker(broker, asyncio.Event()), 30)

        with pytest.raises(up.UpError, match="could not restart nats-server") as e:
            asyncio.run(watch())
        assert "\n" not in str(e.value)
    finally:
        broker.stop()
