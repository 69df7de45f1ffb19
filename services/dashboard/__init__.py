"""The dashboard: a live web page of the cluster, a list-and-watch HTTP API over the log,
and Prometheus metrics, for the operator's second screen and for Grafana.

Called by `llmgw dashboard` and `llmgw up` (`server.Dashboard`). One subscription to
the log per process (`hub`), fanned out to every client with a bounded queue each. It
is read-only: nothing it serves publishes, writes to the broker or decides.
"""

from services.dashboard.server import DEFAULT_LISTEN, Dashboard, DashboardError

__all__ = ["DEFAULT_LISTEN", "Dashboard", "DashboardError"]
