"""Prometheus metrics of the gateway: `GET /metrics` on the gateway's own port.

Called by `services.gateway.server` as each request ends. Requests by model and status
and by the owner of their API key (with their tokens, and refusals by a key's limit),
time to first byte and total duration, the gateway's own share of a request (parse and
route, before the replica is asked), retries, requests in flight and held per model,
demand published, and the wake (a ready folded to the first held request's first byte). Model
labels are declared models only (anything else is `(unknown)`), so what clients send
cannot grow the series; a request refused before its body was read (no valid key, a key
over its rpm, a body past the budget) is `(not read)`: its model was never known. One registry per gateway: two in one process (tests) do not
share counters.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
UNKNOWN = "(unknown)"
# NOT_READ labels the model of a request refused before its body (which names the model)
# was read: `(unknown)` there read as a model nobody declared.
NOT_READ = "(not read)"
# NO_OWNER labels requests without an API key (a gateway without keys, a 401).
NO_OWNER = "(none)"

# BUCKETS reach from the gateway's own sub-millisecond work to a long generation.
BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "llmgw_gateway_requests",
            "Requests answered, by model and HTTP status",
            ["model", "status"],
            registry=r,
        )
        self.first_byte = Histogram(
            "llmgw_gateway_time_to_first_byte_seconds",
            "From the request's arrival to the replica's first byte passed on",
            ["model"],
            buckets=BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "llmgw_gateway_request_duration_seconds",
            "From the request's arrival to its last byte",
            ["model"],
            buckets=BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "llmgw_gateway_added_seconds",
            "The gateway's own share: from the body read to the replica asked (parse, route)",
            buckets=BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "llmgw_gateway_errors",
            "Requests the gateway refused or could not serve, by model and reason "
            "(x-llmgw-reason's code: no_replica, upstream_error, rate_limited, ...)",
            ["model", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "llmgw_gateway_retries",
            "Requests tried again on another replica after failing before their first byte",
            registry=r,
        )
        # Owners are those of the key file only (bounded by it), never what a client sends.
        self.owner_requests = Counter(
            "llmgw_gateway_owner_requests",
            "Requests answered, by the owner of their API key and HTTP status",
            ["owner", "status"],
            registry=r,
        )
        self.owner_tokens = Counter(
            "llmgw_gateway_owner_tokens",
            "Tokens of the answers served, by the owner of their API key, in (prompt) or out",
            ["owner", "direction"],
            registry=r,
        )
        self.limited = Counter(
            "llmgw_gateway_rate_limited",
            "Requests refused with 429 by their key's limit, by owner and limit (rpm, tpm)",
            ["owner", "limit"],
            registry=r,
        )
        self.inflight = Gauge(
            "llmgw_gateway_inflight",
            "Requests in flight through the gateway, by model",
            ["model"],
            registry=r,
        )

        self.held = Gauge(
            "llmgw_gateway_held",
            "Requests held in the waiting room, by model (for a start, or a free slot)",
            ["model"],
            registry=r,
        )
        self.demanded = Counter(
            "llmgw_gateway_demanded",
            "model.demanded events published, by model",
            ["model"],
            registry=r,
        )
        self.wake = Histogram(
            "llmgw_gateway_wake_seconds",
            "From the fold of a replica's ready to the first byte of the first held "
            "request it released",
            buckets=BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Labelled:
    """A metric's child for some label values: the plain rule, prometheus_client's
    `labels()` each time (its checks and its lock, about 1.8 us a call; a request makes
    five or six)."""

    def of(self, metric: Any, *values: str) -> Any:
        return metric.labels(*values)


class KeptLabelled(Labelled):
    """The same children, each kept once it is made: a dict lookup. The label values are
    what `Labelled` is given, bounded as the series themselves are (declared models,
    statuses, the key file's owners). The gateway's fast path (`Gateway.fast_path`, off
    with `--no-fast-path`)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def of(self, metric: Any, *values: str) -> Any:
        key = (metric, values)
        child = self._kept.get(key)
        if child is None:
            child = self._kept[key] = metric.labels(*values)
        return child


@dataclass
class Counts:
    """What the gateway has done, for tests and for /health."""

    requests: int = 0
    retries: int = 0
    refused: dict[int, int] = field(default_factory=dict)
    by_model: dict[str, int] = field(default_factory=dict)
    """Requests per declared model (under its name, not an alias) since the start."""
    demanded: int = 0
    """`model.demanded` events published."""
    wakes: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    """Seconds from the fold of a ready to the first byte of the first request it
    released, latest last."""
    sends: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    """Seconds from the fold of a ready to the first request it released being sent to
    the replica: the gateway's own share of the wake."""


def summary(xs: deque[float]) -> dict[str, float]:
    """How many, and the median and 99th percentile in ms, of the latest wakes."""
    if not xs:
        return {"n": 0}
    got = sorted(xs)
    n = len(got)
    return {
        "n": n,
        "p50": round(got[n // 2] * 1e3, 3),
        "p99": round(got[min(n - 1, int(n * 0.99))] * 1e3, 3),
    }
