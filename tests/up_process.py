"""`llmgw up` and other `llmgw` commands as real processes, the way an operator runs them:
one helper for the end-to-end tests (the plane found through its data directory, stopped
by Ctrl-C, its output kept in a file)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

# FAST are the simulated runtime's delays that keep a test's replicas quick to come up.
FAST = ("--load-delay", "0.05", "--start-delay", "0.01")


def env_for(data: Path) -> dict[str, str]:
    """This process's environment, pointed at `data` (and at no broker given by hand)."""
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_NATS"}
    env["LLMGW_DATA"] = str(data)
    return env


def llmgw(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """One `llmgw` command, run to its end."""
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


class UpProcess:
    """`llmgw up --port 0 ARGS` on `data`, its output in `log`, in a process group of its
    own (so a test can kill it, and whatever it started, as a crash would). `command`
    runs another long-lived command the same way (`("agent",)`, `("events", "tail")`);
    `env` adds to the environment."""

    def __init__(
        self,
        data: Path,
        log: Path,
        *args: str,
        command: tuple[str, ...] = ("up", "--port", "0"),
        env: dict[str, str] | None = None,
    ) -> None:
        self.data = data
        self.log = log
        self.env = env_for(data) | (env or {})
        self._out = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *command, *args],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_url(self, timeout: float = 30) -> str:
        """The broker URL `up` recorded in its data directory, once it is there."""
        deadline = time.monotonic() + timeout
        path = self.data / "nats.url"
        while not path.exists():
            assert self.alive(), self.text()[-3000:]
            assert time.monotonic() < deadline, "llmgw up recorded no broker URL"
            time.sleep(0.05)
        return path.read_text().strip()

    def llmgw(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A command beside this `up`, finding it through the data directory."""
        return llmgw(*args, env=self.env)

    def stop(self) -> int:
        """Ctrl-C, then kill the group if it does not stop in 30 s; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()
        return self.proc.returncode


def reader_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a reader's shell: their HOME (so `~/.llmgw` is the test's), this
    interpreter's bin first on PATH (`llmgw` as the venv has it), and no `LLMGW_` or
    `OTEL_` variable of the test's own."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "OTEL_"))},
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


@contextlib.contextmanager
def shell_up(
    command: str, cwd: Path, env: dict[str, str], log: Path, timeout: float = 90
) -> Iterator[subprocess.Popen[bytes]]:
    """`command` (a docs page's `llmgw up ...` line) run by bash as a reader would, its
    output in `log`, until its gateway's address is in the data directory of `env`'s
    HOME; Ctrl-C at the end (then kill -9 of its group after 30 s)."""
    data = Path(env["HOME"]) / ".llmgw"
    out = log.open("w")
    up = subprocess.Popen(
        ["bash", "-c", f"exec {command}"],
        cwd=cwd,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while not (data / "gateway.url").is_file() or not (data / "gateway.url").read_text():
            assert up.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield up
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        out.close()
