"""The shipped nats-server configs (deploy/nats/), rendered for a test and run for real.

Rendering copies the shipped files into a temporary directory and changes only what a
test must: the store directory, and every address to a free loopback port. The users
come from the shipped users.py and agent.conf.in, for the test's own nodes. Each
substitution checks that the text it replaces is there, so a config that changes shape
fails here rather than being tested half-rendered.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "nats"
NATS_SERVER = str(Path(sys.executable).with_name("nats-server"))

# The tests' own passwords: users.py refuses the examples' placeholders (change-me-*).
CONTROL_PASSWORD = "test-control-pw"
VIEWER_PASSWORD = "test-viewer-pw"
ROUTE_PASSWORD = "test-route-pw"


def agent_password(node: str) -> str:
    return f"test-pw-{node}"


def users_module() -> ModuleType:
    """deploy/nats/users.py, the shipped renderer of users.conf."""
    spec = importlib.util.spec_from_file_location("llmgw_deploy_users", DEPLOY / "users.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# PORTS: where a rendered server's ports are taken from: below the kernel's ephemeral range
# (32768-60999), which outgoing connections draw from, and one slice per pytest-xdist
# worker, so a port found free here is not taken by another worker's connection or server
# between this check and the server's bind (a cluster's route port lost that race).
PORTS = range(12000, 32000)
_SLICE = 2000


def free_port() -> int:
    """A port free now, from this worker's slice of `PORTS`, never one handed out before by
    this process (a cluster's nine ports drawn at random collided)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    n = int(worker) if worker.isdigit() else 0
    start = PORTS.start + (n * _SLICE) % len(PORTS)
    for _ in range(_SLICE):
        port = start + next(_NEXT) % _SLICE
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {start}-{start + _SLICE}")


# _NEXT: the offsets in the slice handed out, in turn from a random start (a test run that
# starts again soon after does not meet its predecessor's ports in TIME_WAIT).
_NEXT = itertools.count(random.randrange(_SLICE))


def _sub(text: str, old: str, new: str, *, count: int = 1) -> str:
    found = text.count(old)
    assert found == count, f"expected {count} of {old!r} in a shipped config, found {found}"
    return text.replace(old, new)


@dataclass
class Rendered:
    conf: Path
    port: int
    http_port: int
    cluster_port: int | None = None

    def url(self, user: str, password: str) -> str:
        return f"nats://{user}:{password}@127.0.0.1:{self.port}"


@dataclass
class Certs:
    """A CA and a server certificate it signed (PEM files), made with the openssl CLI."""

    ca: Path
    ca_key: Path
    server: Path
    server_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def make_ca(into: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (its certificate, its key)."""
    into.mkdir(parents=True, exist_ok=True)
    cert, key = into / f"{name}.pem", into / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
        "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return cert, key


def make_certs(into: Path, names: tuple[str, ...] = ("localhost",)) -> Certs:
    """A CA and a server certificate for `names` (DNS names or IPs) signed by it."""
    ca, ca_key = make_ca(into, "ca")
    server, key, csr = into / "server.pem", into / "server.key", into / "server.csr"
    san = ",".join(f"IP:{n}" if n.replace(".", "").isdigit() else f"DNS:{n}" for n in names)
    ext = into / "server.ext"
    ext.write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth\n")
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={names[0]}",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", str(server), "-days", "2", "-extfile", str(ext),
    )  # fmt: skip
    return Certs(ca, ca_key, server, key)


def render_tls(into: Path, certs: Certs | None) -> None:
    """tls.conf: the shipped one on `certs`' files, or (None) no TLS at all, for the
    tests of other things, whose clients speak plain NATS."""
    if certs is None:
        (into / "tls.conf").write_text("# no TLS in this test\n")
        return
    text = (DEPLOY / "tls.conf").read_text()
    text = _sub(text, "/etc/llmgw/nats/tls/server.pem", str(certs.server))
    text = _sub(text, "/etc/llmgw/nats/tls/server.key", str(certs.server_key))
    text = _sub(text, '"/etc/llmgw/nats/ca.pem"', f'"{certs.ca}"')
    (into / "tls.conf").write_text(text)


def render_users(into: Path, nodes: list[str], certs: Certs | None = None) -> None:
    """permissions.conf and agent.conf.in as shipped, users.conf from users.py; tls.conf
    (see render_tls)."""
    into.mkdir(parents=True, exist_ok=True)
    for name in ("permissions.conf", "agent.conf.in"):
        (into / name).write_text((DEPLOY / name).read_text())
    render_tls(into, certs)
    agents = {n: agent_password(n) for n in nodes}
    (into / "users.conf").write_text(
        users_module().render(agents, CONTROL_PASSWORD, VIEWER_PASSWORD)
    )


def render_single(into: Path, nodes: list[str]) -> Rendered:
    render_users(into, nodes)
    port, http = free_port(), free_port()
    text = (DEPLOY / "single.conf").read_text()
    text = _sub(text, "listen: 127.0.0.1:4222", f"listen: 127.0.0.1:{port}")
    text = _sub(text, "http: 127.0.0.1:8222", f"http: 127.0.0.1:{http}")
    text = _sub(text, "store_dir: /var/lib/llmgw/jetstream", f"store_dir: {into / 'js'}")
    conf = into / "single.conf"
    conf.write_text(text)
    return Rendered(conf, port, http)


def render_fleet(into: Path, nodes: list[str], certs: Certs) -> Rendered:
    """fleet.conf, TLS on `certs`, listening on loopback."""
    render_users(into, nodes, certs)
    port, http = free_port(), free_port()
    text = (DEPLOY / "fleet.conf").read_text()
    text = _sub(text, "listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{port}")
    text = _sub(text, "http: 127.0.0.1:8222", f"http: 127.0.0.1:{http}")
    text = _sub(text, "store_dir: /var/lib/llmgw/jetstream", f"store_dir: {into / 'js'}")
    conf = into / "fleet.conf"
    conf.write_text(text)
    return Rendered(conf, port, http)


def render_cluster(into: Path, nodes: list[str], certs: Certs | None = None) -> list[Rendered]:
    """The three cluster-N.conf, each in its own directory, routed over loopback; with
    `certs`, the shipped tls.conf on them (else no TLS)."""
    ports = [(free_port(), free_port(), free_port()) for _ in range(3)]
    out = []
    for n in range(1, 4):
        d = into / f"n{n}"
        render_users(d, nodes, certs)
        port, http, cport = ports[n - 1]
        text = (DEPLOY / f"cluster-{n}.conf").read_text()
        text = _sub(text, "listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{port}")
        text = _sub(text, "http: 127.0.0.1:8222", f"http: 127.0.0.1:{http}")
        text = _sub(text, "listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{cport}")
        text = _sub(text, "store_dir: /var/lib/llmgw/jetstream", f"store_dir: {d / 'js'}")
        hosts = [f"127.0.0.1:{ports[m][2]}" for m in range(3)]
        (d / "routes.conf").write_text(users_module().render_routes(ROUTE_PASSWORD, hosts))
        conf = d / f"cluster-{n}.conf"
        conf.write_text(text)
        out.append(Rendered(conf, port, http, cport))
    return out


# ---------------------------------------------------------------------- processes


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, wait_s: float = 15.0) -> None:
    """Stop a process started with start_new_session, its whole group, for sure."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(wait_s)


def monitor(http_port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}{path}", timeout=2) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def wait_for(what: str, cond: Any, within: float = 30.0, every: float = 0.05) -> Any:
    """Poll `cond()` until it returns something true, or fail saying `what`."""
    deadline = time.monotonic() + within
    last: Any = None
    while True:
        try:
            last = cond()
        except (OSError, ValueError) as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} (last: {last!r})")
        time.sleep(every)


@contextlib.contextmanager
def server(r: Rendered, log: Path, *, jetstream: bool = True) -> Iterator[subprocess.Popen[Any]]:
    """nats-server -c r.conf, up (and JetStream ready) before the body runs."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [NATS_SERVER, "-c", str(r.conf)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        path = "/healthz?js-enabled-only=true" if jetstream else "/healthz"

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            return monitor(r.http_port, path).get("status") == "ok"

        wait_for(f"nats-server {r.conf.name}", up)
        yield proc
    finally:
        stop(proc)
