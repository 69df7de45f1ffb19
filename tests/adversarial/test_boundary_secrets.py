"""Secrets never print: the log-scan test. A broker whose password is known runs the
plane's connection paths for real, and the password must appear in no output a person or
a log collector reads:
- `llmgw up --nats URL-with-password`, `llmgw agent`, `events tail` and `status --watch`
  connected to it while the broker is killed (kill -9) and restarted: the lost and
  reconnected lines, and the spans of the console exporter (their attributes);
- a wrong password (`status`, `events tail`): the error line;
- `--help` with the URL in $LLMGW_NATS;
- `llmgw up` on its own broker, which it restarts after a kill -9, and `status` beside it;
- every file left in the data directories but the three kept for the password (0600).

And the one redaction they go through (`services.bus.urls.public_url`), on the shapes of
URL people write.
"""

from __future__ import annotations

import json
import os
import stat
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from services.bus import EmbeddedBroker
from services.bus.broker import CONF_FILE, PASSWORD_FILE, URL_FILE
from services.bus.urls import public_url, redact
from tests.up_process import FAST, UpProcess, env_for, llmgw

pytestmark = pytest.mark.timeout(60)

# PASSWORD is the broker's; WRONG the one a mistyped URL carries. Neither may print.
PASSWORD = "s3cr3t-LOGSCAN-7f2c9a"
WRONG = "wr0ng-LOGSCAN-41d8e0"
SECRETS = (PASSWORD, WRONG)

# KEPT are the broker's files that hold the password on purpose, each mode 0600.
KEPT = (PASSWORD_FILE, URL_FILE, CONF_FILE)


def _until(cond: Callable[[], bool], what: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"not within {within:g}s: {what}"
        time.sleep(0.05)


def _says(p: UpProcess, words: str) -> None:
    _until(lambda: words in p.text(), f"{p.log.name} says {words!r}")


def _clients(b: EmbeddedBroker) -> set[str]:
    """The names of the clients connected to `b` now (its /connz)."""
    url = f"http://127.0.0.1:{b.monitor_port}/connz?limit=1024"
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            got = json.load(r)
    except OSError:
        return set()
    return {c.get("name", "") for c in got.get("connections") or []}


def _leaks(path: Path) -> list[str]:
    data = path.read_bytes()
    return [f"{path}: {s}" for s in SECRETS if s.encode() in data]


def test_the_password_is_in_no_output_of_any_connection_path(tmp_path: Path) -> None:
    home = tmp_path / "broker"
    home.mkdir()
    fd = os.open(home / PASSWORD_FILE, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, PASSWORD.encode() + b"\n")
    os.close(fd)
    broker = EmbeddedBroker(home, auth=True)
    url = broker.start()
    assert PASSWORD in url
    for name in KEPT:
        mode = stat.S_IMODE(os.stat(home / name).st_mode)
        assert mode == 0o600, (name, oct(mode))
    wrong = url.replace(PASSWORD, WRONG)
    data = tmp_path / "data"
    logs = tmp_path / "logs"
    logs.mkdir()
    spans = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "logscan"}
    procs: list[UpProcess] = []
    try:
        procs = [UpProcess(data, logs / "up.log", "--nats", url, "--no-ui", env=spans)]
        # The others once the streams are there: the projector reads them.
        _until(lambda: "llmgw-reader (projector)" in _clients(broker), "up's projector reading")
        procs += [
            UpProcess(
                data,
                logs / "agent.log",
                "--nats",
                url,
                "--node",
                "scan-1",
                "--simulate",
                "--gpus",
                "2xH100-80GB",
                *FAST,
                command=("agent",),
                env=spans,
            ),
            UpProcess(data, logs / "tail.log", command=("events", "tail"), env={"LLMGW_NATS": url}),
            UpProcess(data, logs / "watch.log", "--nats", url, command=("status", "--watch")),
        ]
        names = {"llmgw up", "llmgw agent scan-1", "llmgw events tail", "llmgw status --watch"}
        _until(lambda: names <= _clients(broker), f"all of {names} connected")

        broker.kill()
        for p in procs:
            _says(p, "lost the connection")
        broker.start()
        _until(lambda: names <= _clients(broker), f"all of {names} back")
        for p in procs[:3]:
            _says(p, "reconnected to")

        # A wrong password: one line, without it.
        env = env_for(data)
        for cmd in (("status", "--nats", wrong), ("events", "tail", "--nats", wrong)):
            r = llmgw(*cmd, env=env, timeout=30)
            assert r.returncode != 0, r
            assert r.stderr.startswith("llmgw: "), r.stderr
            (logs / f"{cmd[0]}-wrong.log").write_text(r.stdout + r.stderr)
        # --help, the URL in the environment.
        helped = llmgw("up", "--help", env=env | {"LLMGW_NATS": url}, timeout=30)
        assert helped.returncode == 0, helped.stderr
        (logs / "help.log").write_text(helped.stdout + helped.stderr)
    finally:
        for p in procs:
            p.stop()
        broker.stop()

    leaks = [
        leak
        for where in (logs, data, home)
        for f in sorted(where.rglob("*"))
        if f.is_file() and f.name not in KEPT
        for leak in _leaks(f)
    ]
    assert leaks == [], leaks
    # The paths ran, and said what they say: the lines name the server, not the user.
    said = {p.log.name: p.text() for p in procs}
    assert "lost the connection to nats://127.0.0.1:" in said["up.log"], said["up.log"][-2000:]
    assert '"trace_id"' in said["up.log"], "no span printed: the attributes went unscanned"


def test_the_embedded_brokers_password_is_in_no_output_through_its_restart(
    tmp_path: Path,
) -> None:
    """`llmgw up` on its own broker, which it restarts after a kill -9; a command beside
    it finds the broker through the data directory."""
    data = tmp_path / "data"
    up = UpProcess(data, tmp_path / "up.log", "--no-ui", env={"OTEL_TRACES_EXPORTER": "console"})
    try:
        up.wait_url()
        secret = (data / PASSWORD_FILE).read_text().strip()
        assert secret
        _says(up, "up: ")
        pid = int((data / "nats-server.pid").read_text().split()[0])
        os.kill(pid, 9)
        _says(up, "broker: restarted on")
        _says(up, "reconnected to")
        # The leases may lapse across the restart: until the plane leads again, status
        # says it is not running (exit 1). Every answer it gave is scanned.
        answers = [up.llmgw("status")]
        deadline = time.monotonic() + 30
        while answers[-1].returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
            answers.append(up.llmgw("status"))
        assert answers[-1].returncode == 0, answers[-1].stdout + answers[-1].stderr
    finally:
        up.stop()
    outputs = [up.text(), *(a.stdout for a in answers), *(a.stderr for a in answers)]
    assert not [o for o in outputs if secret in o]
    files = [f for f in data.rglob("*") if f.is_file() and f.name not in KEPT]
    assert files and not [f for f in files if secret.encode() in f.read_bytes()]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://control:pw@h:4222", "nats://h:4222"),
        ("nats://token@h:4222", "nats://h:4222"),
        ("nats://h:4222", "nats://h:4222"),
        ("tls://u:p@ss/w,rd@h:4222", "tls://h:4222"),  # unquoted @ / , in a password
        ("nats://a:x@h1:4222, nats://a:y@h2:4222", "nats://h1:4222,nats://h2:4222"),
        ("control:pw@h:4222", "h:4222"),  # no scheme, as the clients accept it
        ("control:pw@h1:4222,nats://u:q@h2", "h1:4222,nats://h2"),
    ],
)
def test_a_url_is_shown_without_its_credentials(url: str, shown: str) -> None:
    assert public_url(url) == shown


def test_a_message_quoting_urls_loses_their_credentials() -> None:
    text = "lost nats://u:p@h1:4222 (via nats://v:q@h2:4222); mail ops@example.com"
    assert redact(text) == "lost nats://h1:4222 (via nats://h2:4222); mail ops@example.com"
