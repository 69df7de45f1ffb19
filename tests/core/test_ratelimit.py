"""A key's limits as token buckets, with time a parameter: a minute's worth to burst, a
continuous refill, tokens charged at the end and paid back by the refill, and a refused
request that takes nothing."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.core import ratelimit as rl

pytestmark = pytest.mark.timeout(30)


def _run(limits: rl.Limits, times: list[float]) -> list[rl.Admission]:
    b = rl.Buckets()
    out = []
    for t in times:
        a = rl.admit(limits, b, t)
        b = a.buckets
        out.append(a)
    return out


@pytest.mark.parametrize(
    ("limits", "times", "admitted", "last_wait"),
    [
        pytest.param(rl.Limits(), [0.0] * 1000, 1000, 0.0, id="no limits: everything"),
        pytest.param(rl.Limits(rpm=3), [0.0] * 4, 3, 20.0, id="a minute's worth at once"),
        pytest.param(rl.Limits(rpm=3), [0, 0, 0, 20.0], 4, 0.0, id="one back after 60/rpm s"),
        pytest.param(rl.Limits(rpm=3), [0, 0, 0, 10.0], 3, 10.0, id="half of one back: wait"),
        pytest.param(
            rl.Limits(rpm=60), [0.0] * 60 + [1000.0] * 61, 120, 1.0, id="never above a minute"
        ),
        pytest.param(rl.Limits(rpm=0), [0.0], 0, math.inf, id="rpm=0: refused for good"),
    ],
)
def test_requests_a_minute(
    limits: rl.Limits, times: list[float], admitted: int, last_wait: float
) -> None:
    got = _run(limits, times)
    assert sum(a.over is None for a in got) == admitted
    assert got[-1].wait_s == pytest.approx(last_wait)
    assert all(a.over in (None, "rpm") for a in got)


def test_tokens_are_charged_at_the_end_and_the_refill_pays_them_back() -> None:
    limits = rl.Limits(tpm=600)
    a = rl.admit(limits, rl.Buckets(), 0.0)
    assert a.over is None
    # One request took twice the minute's worth: the key is 600 tokens in debt.
    b = rl.charge(limits, a.buckets, 1.0, 1200)
    refused = rl.admit(limits, b, 1.0)
    assert refused.over == "tpm" and refused.buckets == b
    assert refused.wait_s == pytest.approx((600 + 1) * 60 / 600)
    assert rl.admit(limits, b, 1.0 + refused.wait_s).over is None
    # Charging a key without tpm, or nothing, leaves its buckets as they were.
    assert rl.charge(rl.Limits(rpm=5), a.buckets, 1.0, 99) is a.buckets
    assert rl.charge(limits, a.buckets, 1.0, 0) is a.buckets


def test_a_request_refused_for_tokens_takes_no_request() -> None:
    limits = rl.Limits(rpm=2, tpm=10)
    a = rl.admit(limits, rl.Buckets(), 0.0)
    b = rl.charge(limits, a.buckets, 0.0, 50)
    refused = rl.admit(limits, b, 0.0)
    assert refused.over == "tpm" and refused.buckets is b
    # Paid back, it still has the one request it did not spend.
    later = rl.admit(limits, b, refused.wait_s)
    assert later.over is None and later.buckets.requests is not None
    assert later.buckets.requests.level == pytest.approx(min(2.0, 1 + refused.wait_s * 2 / 60) - 1)


@given(
    rpm=st.integers(min_value=1, max_value=100),
    gaps=st.lists(st.floats(min_value=0, max_value=5, allow_nan=False), min_size=1, max_size=300),
)
def test_never_more_than_the_burst_plus_the_rate_over_any_stretch(
    rpm: int, gaps: list[float]
) -> None:
    times = []
    t = 0.0
    for g in gaps:
        t += g
        times.append(t)
    got = _run(rl.Limits(rpm=rpm), times)
    ok = [t for t, a in zip(times, got, strict=True) if a.over is None]
    # Invariant: over any stretch [s, e], admitted <= a minute's worth + the refill.
    for i, s in enumerate(ok):
        for j in range(i, len(ok)):
            assert j - i + 1 <= rpm + (ok[j] - s) * rpm / 60 + 1e-9
    # And a refused request was told a wait after which it is admitted.
    b = rl.Buckets()
    for t in times:
        a = rl.admit(rl.Limits(rpm=rpm), b, t)
        if a.over is not None:
            assert rl.admit(rl.Limits(rpm=rpm), b, t + a.wait_s + 1e-9).over is None
        b = a.buckets


def test_a_reservation_is_taken_at_admission_and_settled_to_what_the_request_took() -> None:
    limits = rl.Limits(tpm=100)
    # 20 requests sent together, each of up to 100 tokens: the first takes the minute,
    # the others wait for it (they cannot each spend the same minute).
    b = rl.Buckets()
    admitted = []
    for _ in range(20):
        a = rl.admit(limits, b, 0.0, reserve=108)
        b = a.buckets
        if a.over is None:
            admitted.append(a)
    assert len(admitted) == 1 and admitted[0].reserved == 100.0
    refused = rl.admit(limits, b, 0.0, reserve=108)
    # A request larger than the minute waits for the bucket full: 100 tokens, a minute.
    assert refused.over == "tpm" and refused.wait_s == pytest.approx(60.0)
    # It took 30: the rest of its reservation is given back.
    b = rl.settle(limits, b, 0.0, admitted[0].reserved, 30)
    assert rl.level(b.tokens, 100, 0.0) == pytest.approx(70.0)
    small = rl.admit(limits, b, 0.0, reserve=20)
    assert small.over is None and small.reserved == 20.0
    # It took more than it reserved: the key owes the difference.
    b = rl.settle(limits, small.buckets, 0.0, small.reserved, 90)
    assert rl.level(b.tokens, 100, 0.0) == pytest.approx(-20.0)
    # Settling never fills past a minute's worth; a key without tpm is left as it was.
    full = rl.settle(limits, rl.Buckets(), 0.0, 100.0, 0)
    assert rl.level(full.tokens, 100, 0.0) == 100.0
    assert rl.settle(rl.Limits(rpm=5), b, 0.0, 10.0, 3) is b


@given(
    tpm=st.integers(min_value=1, max_value=1000),
    asks=st.lists(st.integers(min_value=0, max_value=2000), min_size=1, max_size=100),
)
def test_requests_in_flight_together_never_reserve_past_a_minute(tpm: int, asks: list[int]) -> None:
    """However many are sent at once, the reservations of those admitted add up to at
    most a minute's worth, each at most what it asked for."""
    b = rl.Buckets()
    reserved = 0.0
    for ask in asks:
        a = rl.admit(rl.Limits(tpm=tpm), b, 0.0, reserve=ask)
        b = a.buckets
        if a.over is None:
            reserved += a.reserved
            assert a.reserved <= ask
    assert reserved <= tpm + 1e-9


# ------------------------------------------------------------------ shares of a fleet


def test_a_key_shared_by_three_gateways_is_a_third_each_refilled_a_third_as_fast() -> None:
    whole = rl.Limits(rpm=90, tpm=900)
    third = rl.share(whole, 3)
    assert (third.rpm, third.tpm) == (30, 300)
    assert rl.share(whole, 1) is whole
    admitted = 0
    b = rl.Buckets()
    while rl.admit(third, b, 0.0).over is None:
        b = rl.admit(third, b, 0.0).buckets
        admitted += 1
    assert admitted == 30
    assert rl.level(b.requests, 30, 60.0) == 30.0  # a minute refills the third


def test_what_a_gateway_hands_on_leaves_it_as_it_joins_the_other() -> None:
    third = rl.share(rl.Limits(rpm=90, tpm=900), 3)
    giver, taker = rl.Buckets(), rl.Buckets()
    for _ in range(30):
        taker = rl.admit(third, taker, 0.0).buckets
    giver, r, t = rl.give(third, giver, 0.0, 0.5)
    assert (r, t) == (15.0, 150.0)
    taker = rl.receive(third, taker, 0.0, r, t)
    held = rl.level(giver.requests, 30, 0.0) + rl.level(taker.requests, 30, 0.0)
    assert held == 30.0  # nothing made, nothing lost
    # Given past its share's minute, a bucket keeps it (and refills no more meanwhile).
    full = rl.receive(third, rl.Buckets(), 0.0, 10.0, 0.0)
    assert rl.level(full.requests, 30, 30.0) == 40.0
    # Cut to a smaller share as gateways join.
    cut = rl.clip(rl.share(rl.Limits(rpm=90), 4), full, 30.0)
    assert rl.level(cut.requests, 22.5, 30.0) == 22.5
