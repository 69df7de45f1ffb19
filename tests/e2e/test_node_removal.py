"""A node gone for good, as an operator meets it: the README's cluster of three nodes,
then the tour's two on the same data directory. `up` says in one line which nodes of
the log it does not simulate; they are reported lost (the dashboard's
`llmgw_node_state{state="lost"}`, what `LlmgwNodeLost` fires on, and `status`'s
banner); `llmgw delete node` removes one, and the banner, the totals and the series
behind the alert are clear of it. Real processes: `llmgw up` and the CLI."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.deploy.natsconf import wait_for
from tests.up_process import FAST, UpProcess

pytestmark = [pytest.mark.timeout(120)]


def _metrics(data: Path) -> str:
    url = (data / "dashboard.url").read_text().strip()
    base = url.split("?")[0].rstrip("/")
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
        text: str = r.read().decode()
    return text


def test_a_node_left_behind_is_said_lost_and_removed(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = UpProcess(data, tmp_path / "up1.log", "--simulate", "3x8xH100-80GB", *FAST)
    try:
        wait_for("the first up to run", lambda: "preemption service" in first.text())
        wait_for(
            "three nodes in the view",
            lambda: (
                len(json.loads(first.llmgw("status", "--json").stdout or "{}").get("nodes", []))
                == 3
            ),
        )
    finally:
        assert first.stop() == 0
    timing = ("--node-timeout", "1", "--lost-grace", "0", "--heartbeat", "0.2")
    up = UpProcess(data, tmp_path / "up2.log", "--simulate", "2x8xH100-80GB", *FAST, *timing)
    try:
        said = wait_for(
            "up to name the node it does not simulate",
            lambda: [line for line in up.text().splitlines() if "does not simulate" in line],
        )
        assert len(said) == 1 and "1 node this run does not simulate (sim-2)" in said[0], said
        assert "llmgw delete node" in said[0]
        wait_for(
            "sim-2 reported lost, in /metrics",
            lambda: 'llmgw_node_state{node="sim-2",state="lost"} 1' in _metrics(data),
        )
        status = up.llmgw("status")
        assert "NODES  3 (1 lost, 0 cordoned); GPUs in use 0/16 (8 more on lost nodes)" in (
            status.stdout
        ), status.stdout

        gone = up.llmgw("delete", "node", "sim-2", "--yes")
        assert gone.returncode == 0 and "node.removed sim-2" in gone.stdout, gone.stderr
        wait_for("sim-2 out of /metrics", lambda: 'node="sim-2"' not in _metrics(data))
        status = up.llmgw("status")
        assert "NODES  2 (0 lost, 0 cordoned); GPUs in use 0/16" in status.stdout, status.stdout
        assert "sim-2" not in status.stdout
        explained = up.llmgw("explain", "node", "sim-2")
        assert "node sim-2 was removed" in explained.stdout, explained.stdout + explained.stderr
    finally:
        up.stop()
    assert "Traceback" not in up.text(), up.text()[-3000:]
