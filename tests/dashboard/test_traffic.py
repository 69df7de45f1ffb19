"""Requests a second and in flight per model (services.dashboard.traffic): from the log's
`replica.used` reports over their window, and from a gateway's own counters, which win."""

from __future__ import annotations

from collections import deque
from datetime import UTC, datetime, timedelta

from services.dashboard.health import growth
from services.dashboard.traffic import Traffic

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_the_logs_reports_are_a_rate_over_their_window_and_in_flight_is_unknown() -> None:
    t = Traffic(log_window_s=60)
    t.used("chat", T0, 600)
    t.used("chat", T0 + timedelta(seconds=30), 600)
    t.used("batch", T0 + timedelta(seconds=30), 60)
    assert t.doc(T0 + timedelta(seconds=45)) == {
        "chat": {"rps": 20.0, "inflight": None, "held": None, "hit": None, "source": "log"},
        "batch": {"rps": 1.0, "inflight": None, "held": None, "hit": None, "source": "log"},
    }
    # The first report has left the window; past the second too, the model is gone.
    assert t.doc(T0 + timedelta(seconds=75))["chat"]["rps"] == 10.0
    assert t.doc(T0 + timedelta(seconds=120)) == {}


def test_a_gateways_counters_are_a_rate_over_their_samples_and_win_over_the_log() -> None:
    t = Traffic(gateway_window_s=10)
    t.used("chat", T0, 6000)
    t.sample(100.0, {"chat": 1000}, {"chat": 7})
    assert t.doc(T0)["chat"] == {
        "rps": 0.0,
        "inflight": 7,
        "held": None,
        "hit": None,
        "source": "gateway",
    }
    t.sample(105.0, {"chat": 1500, "embed": 10}, {"chat": 3})
    doc = t.doc(T0)
    assert doc["chat"] == {
        "rps": 100.0,
        "inflight": 3,
        "held": None,
        "hit": None,
        "source": "gateway",
    }
    assert doc["embed"] == {
        "rps": 2.0,
        "inflight": 0,
        "held": None,
        "hit": None,
        "source": "gateway",
    }
    # Samples older than the window go: the rate is of the last ten seconds.
    t.sample(112.0, {"chat": 1500, "embed": 10}, {})
    assert t.doc(T0)["chat"] == {
        "rps": 0.0,
        "inflight": 0,
        "held": None,
        "hit": None,
        "source": "gateway",
    }


def test_the_prefix_caches_hit_rate_per_model_is_of_the_reports_that_said_it() -> None:
    """`hit`: of the prompt tokens the window's reports counted, the share their engines
    served from cache, over the reports that said so; None where none did; and the same
    on a gateway's row, whose counters say nothing of the cache."""
    t = Traffic(log_window_s=60)
    t.used("chat", T0, 10, tokens_in=4000, tokens_cached=3000)
    t.used("chat", T0 + timedelta(seconds=30), 10, tokens_in=1000, tokens_cached=0)
    t.used("chat", T0 + timedelta(seconds=30), 10, tokens_in=5000)  # said nothing of it
    t.used("batch", T0 + timedelta(seconds=30), 10, tokens_in=1000)
    doc = t.doc(T0 + timedelta(seconds=45))
    assert doc["chat"]["hit"] == 0.6 and doc["batch"]["hit"] is None
    t.sample(100.0, {"chat": 30}, {"chat": 1})
    assert t.doc(T0 + timedelta(seconds=45))["chat"]["hit"] == 0.6
    # The first report left the window: 0 of the 1,000 said.
    assert t.doc(T0 + timedelta(seconds=75))["chat"]["hit"] == 0.0


def test_a_gateways_waiting_room_is_held_per_model() -> None:
    t = Traffic()
    t.sample(100.0, {"chat": 10}, {"chat": 2}, {"quiet": 3, "chat": 0})
    doc = t.doc(T0)
    # A model with requests held and nothing served yet is shown; an empty line is 0.
    assert doc["quiet"] == {"rps": 0.0, "inflight": 0, "held": 3, "hit": None, "source": "gateway"}
    assert doc["chat"]["held"] == 0
    t.sample(101.0, {"chat": 10, "quiet": 1}, {"chat": 2}, {})
    assert t.doc(T0)["quiet"]["held"] == 0


def test_dead_letters_grow_by_what_was_added_within_the_window() -> None:
    seen: deque[tuple[float, dict[str, int]]] = deque()
    # What was there when the dashboard started is no growth.
    assert growth(seen, 0.0, {"projector": 4}, 300) == {}
    assert growth(seen, 10.0, {"projector": 5, "scheduler": 1}, 300) == {
        "projector": 1,
        "scheduler": 1,
    }
    # Past the window the old counts go: nothing added since is no growth.
    assert growth(seen, 320.0, {"projector": 5, "scheduler": 1}, 300) == {}
    # Purged (fewer than before): no growth either.
    assert growth(seen, 330.0, {"projector": 0}, 300) == {}
