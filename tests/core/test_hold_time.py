"""A hold lasts the hold the log records, from its event's time as the log bounds it: a
host clock an hour fast when the hold was made cannot make it last an hour once the
clock is right again, nor can an `until` that claims more or less than the recorded
hold. A log without `policy.configured` folds as it always did."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from schemas import codec, subjects
from schemas import events as ev
from services.core import ingest

STORED = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)


def _policy(hold_s: float) -> ev.PolicyConfigured:
    return ev.PolicyConfigured(
        hold_s=hold_s, eviction_grace_s=60, min_lifetime_s=0, max_victims=3, drain_grace_s=5
    )


def _fold(items: list[tuple[ev.Data, datetime]], stored: datetime = STORED) -> ingest.Ingest:
    """Each (data, the time its producer claims) stored, in order, at `stored`."""
    step = ingest.Ingest()
    stored_ns = int(stored.timestamp() * 1e9)
    for seq, (data, claimed) in enumerate(items, 1):
        e = ev.make(data, id=f"e{seq}", time=claimed, source="preemption/test")
        step.raw(seq, subjects.subject_for(e), codec.encode(e), stored_ns)
    assert step.view.state.rejected == 0
    return step


def _hold(claimed: datetime, until: datetime) -> tuple[ev.Data, datetime]:
    return ev.HoldCreated(model="batch", for_model="chat", until=until), claimed


S = timedelta(seconds=1)


@pytest.mark.parametrize(
    ("policy", "claimed", "until", "want"),
    [
        pytest.param(20, STORED, STORED + 20 * S, STORED + 20 * S, id="an honest clock"),
        pytest.param(
            20,
            STORED + HOUR,
            STORED + HOUR + 20 * S,
            STORED + ingest.MAX_SKEW + 20 * S,
            id="a clock an hour fast: the bounded time plus the hold",
        ),
        pytest.param(
            20, STORED, STORED + HOUR, STORED + 20 * S, id="an until past the hold is cut"
        ),
        pytest.param(
            20, STORED, STORED + 1 * S, STORED + 20 * S, id="an until short of the hold is the hold"
        ),
        pytest.param(
            20,
            STORED - HOUR,
            STORED - HOUR + 20 * S,
            STORED - HOUR + 20 * S,
            id="a slow clock: the hold from the time it claims",
        ),
        pytest.param(
            None,
            STORED + HOUR,
            STORED + HOUR + 20 * S,
            STORED + HOUR + 20 * S,
            id="no policy recorded: the claim stands",
        ),
    ],
)
def test_a_hold_ends_at_its_bounded_time_plus_the_recorded_hold(
    policy: float | None, claimed: datetime, until: datetime, want: datetime
) -> None:
    items = [] if policy is None else [(_policy(policy), STORED)]
    view = _fold([*items, _hold(claimed, until)]).view
    assert view.state.holds["batch"].until == want


def test_the_latest_recorded_hold_counts() -> None:
    view = _fold(
        [(_policy(20), STORED), (_policy(90), STORED), _hold(STORED, STORED + 20 * S)]
    ).view
    assert view.state.holds["batch"].until == STORED + 90 * S


def test_a_hold_made_an_hour_fast_is_over_minutes_later() -> None:
    view = _fold([(_policy(20), STORED), _hold(STORED + HOUR, STORED + HOUR + 20 * S)]).view
    end = STORED + ingest.MAX_SKEW + 20 * S
    assert view.active_hold("batch", end) is not None
    assert view.active_hold("batch", end + S) is None
