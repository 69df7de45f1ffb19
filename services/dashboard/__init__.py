"""The dashboard: a live web page of the cluster, a list-and-watch HTTP API over the log,
and Prometheus metrics, for the operator's second screen and for Grafana.

Called by `llmgw dashboard` and `llmgw up` (`server.Dashboard`). One subscription to
the log per process (`hub`), fanned out to every client with a bounded queue each. It
is read-only: nothing it serves publishes, writes to the broker or decides.

The server (uvicorn, starlette, prometheus_client) is imported when `Dashboard` is first
asked for, not with the package: every `llmgw` command registers `llmgw dashboard`, and
`--help` must not pay for a web server.
"""

from __future__ import annotations

from typing import Any

from services.dashboard.listen import DEFAULT_LISTEN

__all__ = ["DEFAULT_LISTEN", "Dashboard", "DashboardError"]


def __getattr__(name: str) -> Any:
    if name in ("Dashboard", "DashboardError"):
        from services.dashboard import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
