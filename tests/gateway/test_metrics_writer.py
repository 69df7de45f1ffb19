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
    ended,
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
        op = rng.randrange(12)
        if op == 11:
            # A request's end, its three series in one call (`ended`), as the server
            # writes it.
            status = rng.choice(["200", "429"])
            labelled.group(
                ("served", model, status, owner),
                lambda: ended(
                    labelled.of(m.requests, model, status),  # noqa: B023
                    labelled.of(m.owner_requests, owner, status),  # noqa: B023
                    labelled.of(m.duration, model),  # noqa: B023
                ),
            )(_amount(rng))
        elif op == 0:
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
    fused = ended(
        k.of(kept.requests, "m1", "200"),
        k.of(kept.owner_requests, "alice", "200"),
        k.of(kept.duration, "m1"),
    )
    assert fused.__name__ == "written"  # the writes themselves, not the writers' calls


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


def test_a_group_is_made_each_time_plain_and_once_kept() -> None:
    """`group`: the plain rule makes its children each time (prometheus_client's
    `labels()`, as `of` does); the kept one once for its key, the same children after."""
    made: list[str] = []

    def make(model: str) -> tuple[object, ...]:
        made.append(model)
        return (model,)

    plain, kept = Labelled(), KeptLabelled()
    for labelled in (plain, kept):
        for _ in range(3):
            assert labelled.group(("g", "m1"), lambda: make("m1")) == ("m1",)
        assert labelled.group(("g", "m2"), lambda: make("m2")) == ("m2",)
    assert made == ["m1", "m1", "m1", "m2", "m1", "m2"]


def test_the_reported_hit_rate_is_said_only_once_an_engine_reports_one() -> None:
    """A gateway whose engines never said what they served from their cache has no
    `source="reported"` series (not a rate of 0); the first report makes them."""
    from services.core.pickers import make as make_picker
    from services.gateway.routed import Routed

    for labelled in (Labelled(), KeptLabelled()):
        m = Metrics()
        routed = Routed(make_picker("prefix", fast=False), m, labelled)
        routed._hits("m1", 100, 40, None)
        text = m.render().decode()
        assert 'source="predicted"' in text
        assert 'source="reported"' not in text
        routed._hits("m1", 100, 40, 60)
        text = m.render().decode()
        assert 'llmgw_gateway_prefix_hit_rate{model="m1",source="reported"} 0.6' in text
        assert 'llmgw_gateway_prefix_hit_rate{model="m1",source="predicted"} 0.4' in text


def test_the_hit_rates_written_at_a_scrape_are_what_the_answers_said() -> None:
    """`Routed` counts the hit rates at each answer and writes them to the metrics as
    `/metrics` is rendered: however the scrapes fall, what a scrape says is the sums of
    all the answers before it."""
    from services.core.pickers import make as make_picker
    from services.gateway.routed import Routed

    for labelled in (Labelled(), KeptLabelled()):
        m = Metrics()
        routed = Routed(make_picker("prefix", fast=False), m, labelled)
        rng = random.Random(7)
        sums: dict[str, list[int]] = {}
        for _ in range(400):
            model = rng.choice(["m1", "m2"])
            prompt, predicted = rng.randrange(500), rng.randrange(600)
            cached = rng.choice([None, rng.randrange(600)])
            routed._hits(model, prompt, predicted, cached)
            s = sums.setdefault(model, [0, 0, 0, 0])
            s[0] += prompt
            s[1] += min(predicted, prompt)
            if cached is not None:
                s[2] += prompt
                s[3] += min(cached, prompt)
            if rng.random() < 0.1:
                m.render()
        m.render()
        got = m.registry.get_sample_value
        for model, (p, pred, rep, cached_sum) in sums.items():
            assert got("llmgw_gateway_prompt_tokens_total", {"model": model}) == p
            said = {"model": model, "source": "predicted"}
            assert got("llmgw_gateway_cached_tokens_total", said) == pred
            assert got("llmgw_gateway_prefix_hit_rate", said) == pred / p
            reported = {"model": model, "source": "reported"}
            assert got("llmgw_gateway_cached_tokens_total", reported) == cached_sum
            assert got("llmgw_gateway_prefix_hit_rate", reported) == cached_sum / rep
