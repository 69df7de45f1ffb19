"""The shipped 3-node cluster config, run for real on loopback: the three servers route
to each other with the route credentials, and a server without them is refused (it
would otherwise join the cluster and publish anything: commands to every node)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.natsconf import Rendered, free_port, monitor, render_cluster, server, wait_for

pytestmark = pytest.mark.timeout(60)


def _peers(r: Rendered) -> set[str]:
    routes: list[dict[str, Any]] = monitor(r.http_port, "/routez").get("routes") or []
    return {x.get("remote_name", "") for x in routes}


def test_routes_authenticate_and_a_rogue_server_is_refused(tmp_path: Path) -> None:
    nodes = render_cluster(tmp_path / "cluster", ["gpu-a1"])
    names = [f"llmgw-{n}" for n in (1, 2, 3)]
    with contextlib.ExitStack() as stack:
        for n, r in enumerate(nodes, 1):
            stack.enter_context(server(r, tmp_path / f"n{n}.log"))
        for r, me in zip(nodes, names, strict=True):
            wait_for(
                f"{me} routed to both others", lambda r=r, me=me: _peers(r) == set(names) - {me}
            )

        # A server of no credentials of its own, routing to node 1 as the shipped config's
        # routes would, if the route port were open to it.
        rogue = Rendered(tmp_path / "rogue.conf", free_port(), free_port(), free_port())
        rogue.conf.write_text(
            f"server_name: rogue\n"
            f"listen: 127.0.0.1:{rogue.port}\n"
            f"http: 127.0.0.1:{rogue.http_port}\n"
            f"cluster {{\n  name: llmgw\n  listen: 127.0.0.1:{rogue.cluster_port}\n"
            f"  routes: [nats-route://127.0.0.1:{nodes[0].cluster_port}]\n}}\n"
        )
        log1 = tmp_path / "n1.log"
        before = log1.read_text()
        assert "authentication" not in before.lower(), before  # the peers' routes got in
        stack.enter_context(server(rogue, tmp_path / "rogue.log", jetstream=False))
        wait_for(
            "node 1 to refuse the rogue's route",
            lambda: (
                "authorization violation" in log1.read_text().lower()
                or "authentication error" in log1.read_text().lower()
            ),
        )
        assert _peers(nodes[0]) == {"llmgw-2", "llmgw-3"}
        assert _peers(rogue) == set()
