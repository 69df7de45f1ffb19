"""The shipped deploy/nats configs: nats-server accepts each one with the users.conf
users.py writes from agent.conf.in (none is shipped: a server started on the configs as
they are has no users, not users with known passwords), monitoring listens on loopback
only, and cluster routes authenticate."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.deploy.natsconf import (
    DEPLOY,
    NATS_SERVER,
    ROUTE_PASSWORD,
    render_cluster,
    render_single,
    render_tls,
    render_users,
    users_module,
)

pytestmark = pytest.mark.timeout(60)

SERVER_CONFIGS = ["single.conf", "fleet.conf", "cluster-1.conf", "cluster-2.conf", "cluster-3.conf"]


def _check(conf: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [NATS_SERVER, "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize("name", SERVER_CONFIGS)
def test_nats_server_accepts_every_shipped_config(name: str, tmp_path: Path) -> None:
    # As shipped, beside the users.conf users.py writes (none is shipped).
    (tmp_path / name).write_text((DEPLOY / name).read_text())
    render_users(tmp_path, ["gpu-a1", "gpu-a2"])
    (tmp_path / "routes.conf").write_text(users_module().render_routes(ROUTE_PASSWORD))
    r = _check(tmp_path / name)
    assert r.returncode == 0, r.stderr
    assert "is valid" in r.stdout + r.stderr


def test_rendered_configs_are_accepted_too(tmp_path: Path) -> None:
    nodes = ["gpu-x1", "gpu-x2", "rack/7"]  # a name that needs escaping, too
    r = _check(render_single(tmp_path / "single", nodes).conf)
    assert r.returncode == 0, r.stderr
    for c in render_cluster(tmp_path / "cluster", nodes):
        r = _check(c.conf)
        assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", SERVER_CONFIGS)
def test_no_users_conf_is_shipped_so_none_has_a_known_password(name: str) -> None:
    assert "include users.conf" in (DEPLOY / name).read_text()
    assert not (DEPLOY / "users.conf").exists() and not (DEPLOY / "routes.conf").exists()
    r = _check(DEPLOY / name)
    missing = "routes.conf" if name.startswith("cluster") else "users.conf"
    assert r.returncode != 0 and missing in r.stdout + r.stderr


def test_an_agent_user_names_only_its_own_node() -> None:
    block = users_module().agent_user("rack/7", "pw")
    token = "rack~2F7"
    subjects = re.findall(r'"([^"]*[.>*][^"]*)"', block)
    assert subjects, block
    for s in subjects:
        # Every subject an agent may use carries its node's token, or is the stream info,
        # or the gateways' announcements it only reads (who serves, where, how loaded: so
        # that a drain does not wait for a gone one; no node's, nothing it may publish).
        assert token in s or s in ("$JS.API.STREAM.INFO.LLMGW", "llmgw.fleet.gateway.*"), s
    assert ">" not in " ".join(s for s in subjects if s.startswith("llmgw."))
    assert '"_INBOX_rack~2F7.>"' in block and '"_INBOX.>"' not in block


@pytest.mark.parametrize("name", SERVER_CONFIGS)
def test_monitoring_listens_on_loopback_only(name: str) -> None:
    text = (DEPLOY / name).read_text()
    http = re.findall(r"^\s*(?:http|https|http_port|monitor_port)\s*[:=]\s*(\S+)", text, re.M)
    assert http == ["127.0.0.1:8222"]


@pytest.mark.parametrize("name", [n for n in SERVER_CONFIGS if n.startswith("cluster")])
def test_cluster_routes_require_credentials_and_ship_none(name: str) -> None:
    """The routes authenticate with what users.py writes (routes.conf), and no route
    password is shipped: none in the file, no `user:password@` in a route."""
    text = (DEPLOY / name).read_text()
    cluster = text[text.index("cluster {") : text.index("\n}\n", text.index("cluster {"))]
    assert '\n  include "routes.conf"' in cluster, cluster
    assert not re.search(r"^\s*password\s*[:=]", text, re.M) and "change-me" not in text
    assert not re.search(r"nats-route://[^\s/]*@", text)


def test_routes_conf_is_made_with_a_strong_password_kept_in_the_0600_file(
    tmp_path: Path,
) -> None:
    users = users_module()
    pw, routes = tmp_path / "passwords", tmp_path / "routes.conf"
    args = ["--passwords", str(pw), "--out", str(tmp_path / "users.conf"), "--routes", str(routes)]
    assert users.main([*args, "gpu-a1"]) == 0
    made = dict(line.split("=", 1) for line in pw.read_text().splitlines())
    route = made["route"]
    assert len(route) >= 32
    assert len({made["route"], made["control"], made["viewer"], made["gpu-a1"]}) == 4
    assert routes.stat().st_mode & 0o777 == 0o600
    text = routes.read_text()
    assert text.count(f"nats-route://route:{route}@") == 3 and f'password: "{route}"' in text
    # Kept: written again from the same file, the same password.
    assert users.main([*args, "gpu-a1"]) == 0 and routes.read_text() == text
    with pytest.raises(users.UsersError, match="placeholder"):
        users.render_routes("change-me-route")
    # A password that is not URL-safe is quoted in the route URLs.
    assert "nats-route://route:a%40b%3Ac@h:6222" in users.render_routes("a@b:c", ["h:6222"])
    # nats-server takes the shipped cluster config with it.
    (tmp_path / "cluster-1.conf").write_text((DEPLOY / "cluster-1.conf").read_text())
    (tmp_path / "permissions.conf").write_text((DEPLOY / "permissions.conf").read_text())
    render_tls(tmp_path, None)
    r = _check(tmp_path / "cluster-1.conf")
    assert r.returncode == 0, r.stderr
