"""TLS between every llmgw client and the shipped fleet.conf / tls.conf: a real
nats-server on a certificate signed by a self-signed CA (made with the openssl CLI).
The plane (`llmgw up --nats`), an agent and the operator's CLI each verify the server
with --nats-ca or $LLMGW_NATS_CA and work end to end; each one given the wrong CA, or
none, is refused with one line that says why, no traceback and no password; and a
client told to verify is refused by a server that offers no TLS at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.natsconf import (
    CONTROL_PASSWORD,
    NATS_SERVER,
    ROOT,
    VIEWER_PASSWORD,
    Certs,
    Rendered,
    agent_password,
    make_ca,
    make_certs,
    render_cluster,
    render_fleet,
    render_single,
    server,
    wait_for,
)
from tests.deploy.test_permissions_e2e import Procs

pytestmark = pytest.mark.timeout(180)


NODE = "gpu-a1"
PASSWORDS = (CONTROL_PASSWORD, VIEWER_PASSWORD, agent_password(NODE))


def tls_url(r: Rendered, user: str, password: str, host: str = "localhost") -> str:
    return f"tls://{user}:{password}@{host}:{r.port}"


def llmgw(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
        start_new_session=True,
    )


def clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env["LLMGW_DATA"] = str(tmp_path / "data")
    return env


def refusal(r: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused client printed; fails on a traceback or a password."""
    assert r.returncode != 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out
    for pw in PASSWORDS:
        assert pw not in out, out
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return make_certs(tmp_path / "pki")


@pytest.fixture
def wrong_ca(tmp_path: Path) -> Path:
    return make_ca(tmp_path / "other", "other-ca")[0]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path, clean_env(tmp_path))
    try:
        yield p
    finally:
        p.stop_all()


@pytest.mark.slow
def test_every_client_verifies_the_server(
    tmp_path: Path, certs: Certs, wrong_ca: Path, procs: Procs
) -> None:
    r = render_fleet(tmp_path / "nats", [NODE], certs)
    with server(r, tmp_path / "nats-server.log"):
        control = tls_url(r, "control", CONTROL_PASSWORD)
        env = procs.env
        # The plane, with the flag; the agent, with the environment variable.
        up_log = procs.start(
            "up", "up", "--nats-ca", str(certs.ca), "--nats", control, "--tick", "0.2"
        )
        wait_for(
            "llmgw up over TLS",
            lambda: procs.check_alive() or "preemption service" in up_log.read_text(),
        )
        procs.env = {
            **env,
            "LLMGW_NATS": tls_url(r, NODE, agent_password(NODE)),
            "LLMGW_NATS_CA": str(certs.ca),
        }
        procs.start("agent", "agent", "--simulate", "--node", NODE, "--gpus", "2xH100-80GB")
        procs.env = env
        viewer = tls_url(r, "viewer", VIEWER_PASSWORD)

        def nodes() -> list[str]:
            procs.check_alive()
            out = llmgw(env, "--nats-ca", str(certs.ca), "--nats", viewer, "status", "--json")
            assert out.returncode == 0, out.stderr
            return [n["node"] for n in json.loads(out.stdout)["nodes"]]

        assert wait_for("the agent's node in status, over TLS", nodes, within=40) == [NODE]

        # The same clients with another CA: refused, each with one line.
        wrong = {"--nats-ca": str(wrong_ca)}
        for args in (
            ["up", "--nats", control],
            ["agent", "--simulate", "--node", NODE, "--gpus", "2xH100-80GB",
             "--nats", tls_url(r, NODE, agent_password(NODE))],
            ["status", "--nats", viewer],
            ["events", "tail", "--nats", viewer],
        ):  # fmt: skip
            got = refusal(llmgw(env, *[x for kv in wrong.items() for x in kv], *args))
            assert "is not trusted" in got and "certificate" in got, got
            assert "--nats-ca" in got, got
            assert f"localhost:{r.port}" in got, got

        # The CA in the environment, wrong, for the agent as a systemd unit would run it.
        agent_env = {**env, "LLMGW_NATS_CA": str(wrong_ca),
                     "LLMGW_NATS": tls_url(r, NODE, agent_password(NODE))}  # fmt: skip
        got = refusal(
            llmgw(agent_env, "agent", "--simulate", "--node", NODE, "--gpus", "1xH100-80GB")
        )
        assert "is not trusted" in got, got

        # No CA at all: the system's CAs do not know the self-signed one.
        got = refusal(llmgw(env, "status", "--nats", viewer))
        assert "is not trusted" in got and "system's CAs" in got, got

        # The right CA, but a name the certificate does not hold.
        got = refusal(
            llmgw(
                env, "--nats-ca", str(certs.ca), "status",
                "--nats", tls_url(r, "viewer", VIEWER_PASSWORD, host="127.0.0.1"),
            )
        )  # fmt: skip
        assert "is not trusted" in got, got
        procs.check_alive()


def test_a_client_told_to_verify_refuses_a_server_without_tls(tmp_path: Path, certs: Certs) -> None:
    r = render_single(tmp_path / "nats", [NODE])
    with server(r, tmp_path / "nats-server.log"):
        env = clean_env(tmp_path)
        plain = r.url("viewer", VIEWER_PASSWORD)
        # Without a CA the plain server answers (its log is empty: nothing applied yet).
        ok = llmgw(env, "status", "--json", "--nats", plain)
        assert "no event stream" in ok.stderr, ok.stderr
        got = refusal(llmgw(env, "--nats-ca", str(certs.ca), "status", "--nats", plain))
        assert "offers no TLS" in got, got
        tls = plain.replace("nats://", "tls://")
        got = refusal(llmgw(env, "status", "--nats", tls))
        assert "offers no TLS" in got, got
    log = (tmp_path / "nats-server.log").read_text()
    # The refused clients never logged in: the only viewer connection is the first one.
    assert "Authorization Violation" not in log, log


def test_a_bad_ca_file_is_one_line(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    missing = tmp_path / "nope.pem"
    got = refusal(llmgw(env, "--nats-ca", str(missing), "status", "--nats", "tls://127.0.0.1:1"))
    assert "LLMGW_NATS_CA" in got and str(missing) in got, got
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    got = refusal(llmgw(env, "--nats-ca", str(junk), "status", "--nats", "tls://127.0.0.1:1"))
    assert str(junk) in got, got


def test_the_cluster_configs_take_the_shipped_tls_conf(tmp_path: Path, certs: Certs) -> None:
    for r in render_cluster(tmp_path / "cluster", [NODE], certs):
        assert "include tls.conf" in r.conf.read_text()
        checked = subprocess.run(
            [NATS_SERVER, "-t", "-c", str(r.conf)], capture_output=True, text=True, timeout=30
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert str(certs.server) in (r.conf.parent / "tls.conf").read_text()
