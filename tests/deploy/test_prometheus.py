"""The shipped alert rules (`deploy/prometheus/alerts.yaml`): `promtool check rules`,
`promtool test rules` on made-up series (the `for: 5m` ones included), `promtool check
metrics` on a live plane's /metrics (the dashboard's and the gateway's), and a real
Prometheus (Debian's package) scraping that plane, firing LlmgwNodeLost for a node whose
agent is killed -9, and LlmgwPlaneDown once `llmgw up` itself is killed -9.

The real Prometheus evaluates the shipped rules with each `for:` cut to FOR_IN_TESTS
(the same expressions, the same labels and annotations; the durations themselves are
`promtool test rules`'s to check), so a test waits seconds, not minutes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest

from services.bus import broker as bus_broker
from tests.deploy.natsconf import free_port
from tests.up_process import UpProcess

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "alerts.yaml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "alerts.test.yaml"
PROMTOOL = "/usr/bin/promtool"
PROMETHEUS = "/usr/bin/prometheus"
NODE = "gone-1"
FOR_IN_TESTS = "2s"


def _need(path: str) -> None:
    if not os.access(path, os.X_OK):
        pytest.fail(f"no {path}: apt-get install -y prometheus", pytrace=False)


def _promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    _need(PROMTOOL)
    return subprocess.run(
        [PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=60, cwd=RULES.parent
    )


def test_the_rules_check() -> None:
    r = _promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 7 rules found" in r.stdout


def test_the_rules_pass_their_tests() -> None:
    r = _promtool("test", "rules", str(RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_broken_rule_is_caught(tmp_path: Path) -> None:
    bad = tmp_path / "alerts.yaml"
    bad.write_text(
        RULES.read_text().replace("llmgw_model_below_min == 1", "llmgw_model_below_min ==")
    )
    r = _promtool("check", "rules", str(bad))
    assert r.returncode != 0


def _until(what: str, cond: Callable[[], Any], within: float = 60.0) -> Any:
    deadline = time.monotonic() + within
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[tuple[UpProcess, Any, str]]:
    up = UpProcess(
        tmp_path / "data",
        tmp_path / "up.log",
        *("--port", "0", "--tick", "0.2", "--node-timeout", "1", "--lost-grace", "0"),
        *("--ui-listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0"),
        command=("up",),
    )
    agent = None
    try:
        url = up.wait_url()
        _until("up to lead", lambda: "up: scheduler, preemption service" in up.text(), 30)
        for f in ("dashboard.url", "gateway.url"):
            _until(f, (up.data / f).exists, 30)
        out = (tmp_path / "agent.log").open("ab")
        agent = subprocess.Popen(
            [
                *(sys.executable, "-m", "services.cli", "agent", "--simulate", "--nats", url),
                *("--node", NODE, "--gpus", "1xH100-80GB", "--heartbeat", "0.3"),
                *("--load-delay", "0.05", "--start-delay", "0.01"),
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()  # the child has its own copy
        cluster = tmp_path / "cluster.yaml"
        cluster.write_text(
            "models:\n  - name: chat\n    class: critical\n    min: 1\n"
            "    profiles:\n      - {name: one, gpus: 1}\n"
        )
        r = up.llmgw("apply", "-f", str(cluster))
        assert r.returncode == 0, r.stderr
        yield up, agent, (up.data / "dashboard.url").read_text().strip()
    finally:
        if agent is not None and agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)
        up.stop()


def _metrics_url(dashboard: str) -> str:
    u = urlsplit(dashboard)
    return f"{u.scheme}://{u.netloc}/metrics" + (f"?{u.query}" if u.query else "")


def test_live_metrics_check_and_a_lost_node_fires(
    plane: tuple[UpProcess, Any, str], tmp_path: Path
) -> None:
    up, agent, dashboard = plane
    metrics = _metrics_url(dashboard)
    ready = f'llmgw_node_state{{node="{NODE}",state="ready"}} 1.0'

    def both() -> str | None:
        t = _get(metrics)
        live = 'llmgw_model_live_replicas{model="chat"} 1.0'
        # The plane's health is read every few seconds: running once it is next read,
        # and the projector's commit age there once the projector has a position.
        healthy = "llmgw_plane_running 1.0" in t and "llmgw_projector_commit_age_seconds " in t
        return t if ready in t and live in t and healthy else None

    text = _until("the node ready and chat live in /metrics", both)
    for line in (
        'llmgw_model_desired_replicas{model="chat"} 1.0',
        'llmgw_model_min_replicas{model="chat"} 1.0',
        'llmgw_model_max_replicas{model="chat"} 1.0',
        'llmgw_model_below_min{class="critical",model="chat"} 0.0',
        f'llmgw_node_state{{node="{NODE}",state="lost"}} 0.0',
        f'llmgw_node_heartbeat_age_seconds{{node="{NODE}"}}',
        'llmgw_leader{role="scheduler"} 1.0',
        'llmgw_leader{role="preemption"} 1.0',
        "llmgw_projector_commit_age_seconds ",
        "llmgw_holds_active 0.0",
    ):
        assert line in text, (line, text)
    r = _promtool("check", "metrics", stdin=text)
    assert r.returncode == 0, r.stdout + r.stderr
    gateway = (up.data / "gateway.url").read_text().strip().removesuffix("/v1")
    r = _promtool("check", "metrics", stdin=_get(gateway + "/metrics"))
    assert r.returncode == 0, r.stdout + r.stderr

    prom = _Prometheus(tmp_path, dashboard)

    def scraped() -> bool:
        q = prom.query('llmgw_node_state{state="ready"}')
        return any(x["metric"].get("node") == NODE for x in q)

    try:
        _until("Prometheus to scrape the node ready", scraped)
        assert not prom.alerts("LlmgwNodeLost")
        # The node's agent dies as a crash would: its heartbeats stop.
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(10)
        firing = _until("LlmgwNodeLost to fire", lambda: prom.alerts("LlmgwNodeLost", "firing"))
        assert firing[0]["labels"]["node"] == NODE
        assert firing[0]["annotations"]["summary"] == f"node {NODE} is lost"
    finally:
        prom.close()


def test_a_killed_up_fires_the_plane_down_alert(
    plane: tuple[UpProcess, Any, str], tmp_path: Path
) -> None:
    """kill -9 of `llmgw up`: the dashboard it served, and every llmgw_* series with it,
    are gone; the scrape target's `up` is 0 and LlmgwPlaneDown fires for it."""
    up, _, dashboard = plane
    _need(PROMETHEUS)
    prom = _Prometheus(tmp_path, dashboard)
    try:
        _until(
            "Prometheus to scrape the plane running", lambda: prom.query("llmgw_plane_running == 1")
        )
        # Not before: pending while Prometheus had yet to scrape, then gone.
        _until("no LlmgwPlaneDown while the plane runs", lambda: not prom.alerts("LlmgwPlaneDown"))
        os.kill(up.proc.pid, signal.SIGKILL)
        up.proc.wait(10)
        firing = _until("LlmgwPlaneDown to fire", lambda: prom.alerts("LlmgwPlaneDown", "firing"))
        assert len(firing) == 1, firing
        labels = firing[0]["labels"]
        assert labels["job"] == "llmgw" and labels["severity"] == "page", labels
        assert labels["instance"] == urlsplit(dashboard).netloc, labels
        assert "(target " + labels["instance"] + ")" in firing[0]["annotations"]["description"]
        assert not prom.query("llmgw_plane_running"), "the plane's series outlived it"
    finally:
        prom.close()
        # The killed `up`'s broker lives on as an orphan: stop it as the next `up` would.
        bus_broker.stop_orphan(up.data)


class _Prometheus:
    """A real Prometheus scraping the dashboard `dashboard` (job `llmgw`) each second and
    evaluating the shipped rules, each `for:` cut to FOR_IN_TESTS."""

    def __init__(self, tmp_path: Path, dashboard: str) -> None:
        _need(PROMETHEUS)
        rules = tmp_path / "alerts.yaml"
        rules.write_text(re.sub(r"(?m)^(\s+for:) \S+$", rf"\1 {FOR_IN_TESTS}", RULES.read_text()))
        port = free_port()
        config = tmp_path / "prometheus.yml"
        target = urlsplit(dashboard)
        params = {k: [v] for k, v in (p.split("=", 1) for p in target.query.split("&") if p)}
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(rules)],
                    "scrape_configs": [
                        {
                            "job_name": "llmgw",
                            "static_configs": [{"targets": [target.netloc]}],
                            "params": params,
                        }
                    ],
                }
            )
        )
        self.log = (tmp_path / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.api = f"http://127.0.0.1:{port}/api/v1"

    def alerts(self, name: str, state: str | None = None) -> list[dict[str, Any]]:
        """The alerts `name` Prometheus has now (in `state`, if given)."""
        try:
            got = json.loads(_get(self.api + "/alerts"))["data"]["alerts"]
        except OSError:
            return []
        return [
            a
            for a in got
            if a["labels"]["alertname"] == name and (state is None or a["state"] == state)
        ]

    def query(self, q: str) -> list[dict[str, Any]]:
        try:
            got = json.loads(_get(self.api + "/query?" + urlencode({"query": q})))
        except OSError:
            return []
        return list(got["data"]["result"])

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


def test_ci_installs_prometheus_as_the_readme_says() -> None:
    ci = [
        x
        for x in (REPO / ".ci" / "run").read_text().splitlines()
        if "pytest" in x and "apt-get" in x
    ]
    readme = (REPO / "README.md").read_text()
    assert len(ci) == 1 and "apt-get install -y -qq chromium prometheus" in ci[0]
    assert f"\n{ci[0]}\n" in readme, "the README's test command and .ci/run differ"
