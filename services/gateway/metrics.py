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

from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.values import MutexValue

T = TypeVar("T")

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
        self.before_render: list[Callable[[], None]] = []
        """Called as `/metrics` is rendered: what is counted apart (`Routed`'s hit
        rates, written at a scrape, not at each request) written in."""
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

        self.prompt_tokens = Counter(
            "llmgw_gateway_prompt_tokens",
            "Prompt tokens of the answers served, by model",
            ["model"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "llmgw_gateway_cached_tokens",
            "Prompt tokens served from a prefix cache, by model, as the routing rule "
            "predicted (source=predicted) and as the engines reported (source=reported)",
            ["model", "source"],
            registry=r,
        )
        self.hit_rate = Gauge(
            "llmgw_gateway_prefix_hit_rate",
            "The share of prompt tokens served from a prefix cache, by model, predicted by "
            "the routing rule (source=predicted, over all answers) and reported by the "
            "engines (source=reported, over the answers that said)",
            ["model", "source"],
            registry=r,
        )

    def render(self) -> bytes:
        for write in self.before_render:
            write()
        return generate_latest(self.registry)


class Labelled:
    """A metric's child for some label values: the plain rule, prometheus_client's
    `labels()` each time (its checks and its lock, about 1.8 us a call; a request makes
    five or six). No values: the metric itself (one without labels)."""

    def __init__(self) -> None:
        self.groups: dict[tuple[Any, ...], Any] = {}
        """What `group_of` keeps, by key: looked up first by a caller (`groups.get`, a
        dict's own, in C), which asks `group_of` only where it finds nothing. Never
        written here: made each time (`group_of`)."""

    def of(self, metric: Any, *values: str) -> Any:
        return metric.labels(*values) if values else metric

    def group(self, key: tuple[Any, ...], make: Callable[[], T]) -> T:
        """What `make` gives (children `of` several metrics, together): made each time
        here; kept under `key` by `KeptLabelled`, so that a request writes several
        children for one look-up. `key` says everything `make` reads (its labels'
        values), and is bounded as they are."""
        return self.group_of(key, make)

    def group_of(self, key: tuple[Any, ...], make: Callable[..., T], *args: Any) -> T:
        """`group` of `make(*args)`: no function made by the caller for each request (a
        closure, its cells) where the group is kept already."""
        return make(*args)


class KeptLabelled(Labelled):
    """The same children, each kept once it is made: a dict lookup. The label values are
    what `Labelled` is given, bounded as the series themselves are (declared models,
    statuses, the key file's owners). The gateway's fast path (`Gateway.fast_path`, off
    with `--no-fast-path`).

    What it gives for a child is a `Writer` of the child's own values: what the child's
    `inc`, `dec`, `set` and `observe` would write, written without their checks and
    their lock (0.6-2.2 us a call: a dozen calls a request). The gateway writes them
    from its event loop's thread alone, and `/metrics` is read there too.
    (`tests/gateway/test_metrics_writer.py` holds the two equal.)"""

    def __init__(self) -> None:
        super().__init__()
        self._kept: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def of(self, metric: Any, *values: str) -> Any:
        key = (metric, values)
        child = self._kept.get(key)
        if child is None:
            child = self._kept[key] = writer(metric.labels(*values) if values else metric)
        return child

    def group_of(self, key: tuple[Any, ...], make: Callable[..., T], *args: Any) -> T:
        got: T | None = self.groups.get(key)
        if got is None:
            got = self.groups[key] = make(*args)
        return got


class Writer:
    """A gauge's child, written as its `inc`, `dec`, `set` would: its one value
    (prometheus_client's `MutexValue`), in place."""

    __slots__ = ("_v",)

    def __init__(self, child: Any) -> None:
        self._v = child._value

    def inc(self, amount: float = 1) -> None:
        self._v._value += amount

    def dec(self, amount: float = 1) -> None:
        self._v._value -= amount

    def set(self, value: float) -> None:
        self._v._value = float(value)


class CounterWriter:
    """A counter's child, written as its `inc` would (a counter only goes up)."""

    __slots__ = ("_v",)

    def __init__(self, child: Any) -> None:
        self._v = child._value

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._v._value += amount


class HistogramWriter:
    """A histogram's child, written as its `observe` would: the sum, and the count of
    the first bucket whose bound is not below the amount."""

    __slots__ = ("_bounds", "_buckets", "_sum")

    def __init__(self, child: Any) -> None:
        self._sum = child._sum
        self._bounds = tuple(child._upper_bounds)
        self._buckets = list(child._buckets)

    def observe(self, amount: float) -> None:
        self._sum._value += amount
        self._buckets[bisect_left(self._bounds, amount)]._value += 1


def served(
    labelled: Labelled, metrics: Metrics, model: str, status: int, owner: str
) -> Callable[[float], None]:
    """A request's end, of `model` with `status` for `owner`, in its three series
    (`ended`): the group the server keeps for those labels (`Labelled.group_of`)."""
    said = str(status)
    return ended(
        labelled.of(metrics.requests, model, said),
        labelled.of(metrics.owner_requests, owner, said),
        labelled.of(metrics.duration, model),
    )


def sent(labelled: Labelled, metrics: Metrics, model: str) -> tuple[Any, Any]:
    """The overhead histogram and `model`'s in-flight gauge, as a request is sent."""
    return labelled.of(metrics.overhead), labelled.of(metrics.inflight, model)


def ended(requests: Any, by_owner: Any, duration: Any) -> Callable[[float], None]:
    """A request's end in its three series (its model's and its owner's requests, its
    duration), one call where three were: written as `CounterWriter.inc` and
    `HistogramWriter.observe` write when they are the writers; else through the children's
    own `inc` and `observe` (the plain rule, `Labelled`)."""
    if (
        type(requests) is CounterWriter
        and type(by_owner) is CounterWriter
        and type(duration) is HistogramWriter
    ):
        r, o = requests._v, by_owner._v
        total, bounds, buckets = duration._sum, duration._bounds, duration._buckets

        def written(seconds: float) -> None:
            r._value += 1
            o._value += 1
            total._value += seconds
            buckets[bisect_left(bounds, seconds)]._value += 1

        return written

    def each(seconds: float) -> None:
        requests.inc()
        by_owner.inc()
        duration.observe(seconds)

    return each


def writer(child: Any) -> Any:
    """The writer of `child` (a child of a metric, or a metric without labels); the
    child itself where its values are not the plain ones a writer writes
    (prometheus_client's multiprocess mode keeps them in files), where it cannot be
    written (a metric with labels, not a child of it), or where it is another kind."""
    if not child._is_observable():
        return child
    if isinstance(child, Histogram):
        if all(type(b) is MutexValue for b in (child._sum, *child._buckets)):
            return HistogramWriter(child)
        return child
    if type(getattr(child, "_value", None)) is not MutexValue:
        return child
    if isinstance(child, Counter):
        return CounterWriter(child)
    if isinstance(child, Gauge) and not child._is_most_recent:
        return Writer(child)
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
