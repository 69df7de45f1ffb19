"""The metrics' writers (`metrics.KeptLabelled`, the fast path's): what `/metrics` says
after any run of the gateway's metric writes is what prometheus_client's own `inc`,
`dec`, `set` and `observe` (`metrics.Labelled`, `--no-fast-path`) make of the same run,
series for series; a write they refuse is refused the same; a child whose values are not
the plain ones (a gauge in `mostrecent` mode) is written by prometheus_client itself."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Gauge

from services.gateway.metrics import (
    BUCKETS,
    CounterWriter,
    HistogramWriter,
    KeptLabelled,
    Labelled,
    Metrics,
    Writer,
)

pytestmark = [pytest.mark.timeout(60)]

MODELS = ("m1", "m2", "(unknown)")
OWNERS = ("alice", "(none)")


def _series(m: Metrics) -> list[str]:
    """`/metrics`, but for the `_created` series (each registry's own clock)."""
    text = m.render().decode()
    return [line for line in text.splitlines() if "_created" not in line]


def _amount(rng: random.Random) -> float:
    """A duration at a bucket's bound, just past one, far past all, or anywhere."""
    b = rng.choice(BUCKETS)
    return rng.choice([b, b * 1.000001, b * 0.999999, 1e9, 0.0, rng.uniform(0, 400)])


def _run(labelled: Labelled, m: Metrics, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(2000):
        model, owner = rng.choice(MODELS), rng.choice(OWNERS)
        op = rng.randrange(11)
        if op == 0:
            labelled.of(m.requests, model, rng.choice(["200", "429", "503"])).inc()
        elif op == 1:
            labelled.of(m.owner_tokens, owner, rng.choice(["in", "out"])).inc(rng.randrange(5000))
        elif op == 2:
            labelled.of(m.duration, model).observe(_amount(rng))
        elif op == 3:
            labelled.of(m.first_byte, model).observe(_amount(rng))
        elif op == 4:
            labelled.of(m.overhead).observe(_amount(rng))
        elif op == 5:
            labelled.of(m.inflight, model).inc()
        elif op == 6:
            labelled.of(m.inflight, model).dec()
        elif op == 7:
            labelled.of(m.hit_rate, model, "predicted").set(rng.random())
        elif op == 8:
            labelled.of(m.cached_tokens, model, "reported").inc(rng.uniform(0, 100))
        elif op == 9:
            labelled.of(m.retries).inc()
        else:
            labelled.of(m.wake).observe(_amount(rng))


@pytest.mark.parametrize("seed", range(5))
def test_the_writers_leave_what_prometheus_clients_own_writes_leave(seed: int) -> None:
    plain, kept = Metrics(), Metrics()
    _run(Labelled(), plain, seed)
    k = KeptLabelled()
    _run(k, kept, seed)
    assert _series(kept) == _series(plain)
    # The writers were the ones writing, not the children themselves.
    assert isinstance(k.of(kept.duration, "m1"), HistogramWriter)
    assert isinstance(k.of(kept.overhead), HistogramWriter)
    assert isinstance(k.of(kept.requests, "m1", "200"), CounterWriter)
    assert isinstance(k.of(kept.inflight, "m1"), Writer)


def test_a_counter_is_refused_a_step_down_as_prometheus_client_refuses_it() -> None:
    plain, kept = Metrics(), Metrics()
    for labelled, m in ((Labelled(), plain), (KeptLabelled(), kept)):
        with pytest.raises(ValueError, match="non-negative"):
            labelled.of(m.requests, "m1", "200").inc(-1)
    assert _series(kept) == _series(plain)


def test_a_metric_with_labels_asked_without_them_is_refused_as_before() -> None:
    m = Metrics()
    for labelled in (Labelled(), KeptLabelled()):
        with pytest.raises(ValueError):
            labelled.of(m.requests).inc()


def test_a_gauge_in_mostrecent_mode_is_written_by_prometheus_client() -> None:
    g = Gauge("g", "a gauge", ["x"], registry=CollectorRegistry(), multiprocess_mode="mostrecent")
    child = KeptLabelled().of(g, "a")
    assert not isinstance(child, Writer)
    child.set(3)
    assert g.labels("a")._value.get() == 3
