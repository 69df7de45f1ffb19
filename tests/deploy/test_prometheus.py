"""The shipped alert rules (`deploy/prometheus/alerts.yaml`): `promtool check rules`,
`promtool test rules` on made-up series (the `for: 5m` ones included), `promtool check
metrics` on a live plane's /metrics (the dashboard's and the gateway's), and a real
Prometheus (Debian's package) scraping that plane, whose node's agent is killed -9,
firing LlmgwNodeLost for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.deploy.natsconf import free_port
from tests.up_process import UpProcess

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "alerts.yaml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "alerts.test.yaml"
PROMTOOL = "/usr/bin/promtool"
PROMETHEUS = "/usr/bin/prometheus"
NODE = "gone-1"


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
    assert "SUCCESS: 6 rules found" in r.stdout


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

    # A real Prometheus scrapes the dashboard each second, evaluating the shipped rules.
    _need(PROMETHEUS)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    target = urlsplit(dashboard)
    params = {k: [v] for k, v in (p.split("=", 1) for p in target.query.split("&") if p)}
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(RULES)],
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
    log = (tmp_path / "prometheus.log").open("wb")
    prom = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    api = f"http://127.0.0.1:{port}/api/v1"

    def alerts() -> list[dict[str, Any]]:
        try:
            return list(json.loads(_get(api + "/alerts"))["data"]["alerts"])
        except OSError:
            return []

    def scraped() -> bool:
        try:
            q = json.loads(_get(api + '/query?query=llmgw_node_state{state="ready"}'))
        except OSError:
            return False
        return any(x["metric"].get("node") == NODE for x in q["data"]["result"])

    try:
        _until("Prometheus to scrape the node ready", scraped)
        assert not [a for a in alerts() if a["labels"]["alertname"] == "LlmgwNodeLost"]
        # The node's agent dies as a crash would: its heartbeats stop.
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(10)
        firing = _until(
            "LlmgwNodeLost to fire",
            lambda: [
                a
                for a in alerts()
                if a["labels"]["alertname"] == "LlmgwNodeLost" and a["state"] == "firing"
            ],
        )
        assert firing[0]["labels"]["node"] == NODE
        assert firing[0]["annotations"]["summary"] == f"node {NODE} is lost"
    finally:
        os.killpg(prom.pid, signal.SIGKILL)
        prom.wait(10)
        log.close()


def test_ci_installs_prometheus_as_the_readme_says() -> None:
    ci = [
        x
        for x in (REPO / ".ci" / "run").read_text().splitlines()
        if "pytest" in x and "apt-get" in x
    ]
    readme = (REPO / "README.md").read_text()
    assert len(ci) == 1 and "apt-get install -y -qq chromium prometheus" in ci[0]
    assert f"\n{ci[0]}\n" in readme, "the README's test command and .ci/run differ"
