"""The drain drill in the suite, scaled down (50 requests a second for 15 s; the full
200 for 60 s is tests/bench/bench_drain_drill.py): `llmgw up --simulate` with servers
that stop at once on a drain, load through the gateway, and meanwhile a preemption, two
scale-downs and a node drained. Not one request may fail or be routed to a replica after
its drain was folded. With the agents not waiting for the gateway's in-flight requests
(the server stopped as soon as it is told), streams in flight are cut and this fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import drill

pytestmark = pytest.mark.timeout(180)


def test_drains_under_load_cost_no_request(tmp_path: Path) -> None:
    f = drill.run(tmp_path, rate=50, seconds=15)
    report = "\n".join(f.lines())
    assert len(f.answers) == 750, report
    assert not f.errors, report
    assert not f.misroutes, report
    # The drill did drill: each kind of drain happened, to replicas serving the load.
    assert {"preempted", "scale_down", "node_drain"} <= set(f.reasons), report
    assert f.drained_under_load >= 5, report
