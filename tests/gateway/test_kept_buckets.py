"""The keys' buckets kept and updated in place (`admission.Kept`): the same decisions and
the same levels as `services.core.ratelimit`'s pure functions over any run of requests,
alone and sharing the limits with other gateways, and no new buckets made for a request
admitted or settled."""

from __future__ import annotations

import random

import pytest

from services.core import ratelimit
from services.gateway.admission import Admission
from services.gateway.keys import Key
from services.gateway.metrics import KeptLabelled, Metrics
from services.gateway.refusal import Refusal

pytestmark = [pytest.mark.timeout(30)]

METRICS = Metrics()


def _reference(
    limits: ratelimit.Limits,
    b: ratelimit.Buckets,
    reserve: int,
    now: float,
    take: bool,
    n: int,
) -> tuple[ratelimit.Buckets, ratelimit.Admission | None]:
    """What the gateway did before: `ratelimit.admit` on frozen buckets."""
    asked = limits if take else ratelimit.Limits(rpm=limits.rpm)
    if asked.rpm is None and asked.tpm is None:
        return b, None
    asked = ratelimit.share(asked, n)
    a = ratelimit.admit(asked, b, now, reserve if asked.tpm is not None else 0)
    if a.over is None and take:
        b = a.buckets
    return b, a


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "limits",
    [
        ratelimit.Limits(rpm=30, tpm=2000),
        ratelimit.Limits(rpm=5),
        ratelimit.Limits(tpm=500),
        ratelimit.Limits(rpm=0, tpm=100),
        ratelimit.Limits(),
    ],
)
def test_kept_buckets_decide_as_the_pure_rule(limits: ratelimit.Limits, seed: int) -> None:
    rng = random.Random(seed)
    key = Key("team-a", limits, 1, b"k" * 32)
    gateways = [1]
    adm = Admission(KeptLabelled(), METRICS, gateways=(lambda: gateways[0]) if seed % 2 else None)
    ref = ratelimit.Buckets()
    now = 0.0
    seen = 1
    for _ in range(400):
        now += rng.choice([0.0, 0.01, 0.5, 3.0])
        if seed % 2 and rng.random() < 0.03:
            gateways[0] = rng.randint(1, 3)
        n = gateways[0] if seed % 2 else 1
        take = rng.random() < 0.7
        if (limits.rpm is not None or (take and limits.tpm is not None)) and n != seen:
            # The buckets cut to a smaller share as gateways join, when next asked.
            if n > seen:
                ref = ratelimit.clip(ratelimit.share(limits, n), ref, now)
            seen = n
        reserve = rng.choice([0, 1, 50, 300, 5000])
        ref, want = _reference(limits, ref, reserve, now, take, n)
        try:
            got = adm.admit(key, reserve, now, take=take)
        except Refusal as e:
            assert want is not None and want.over is not None, e
            assert e.status == 429
        else:
            assert want is None or want.over is None
            assert got == (0.0 if want is None else want.reserved)
            if take and want is not None and rng.random() < 0.8:
                took = rng.choice([0, 10, 400])
                now += 0.2
                if limits.tpm is not None:
                    ref = ratelimit.settle(ratelimit.share(limits, n), ref, now, got, took)
                adm.settle(key, got, took, now)
        assert adm.buckets.get(key.digest, ratelimit.Buckets()) == ref


def test_a_request_makes_no_new_buckets() -> None:
    key = Key("team-a", ratelimit.Limits(rpm=600, tpm=100000), 1, b"k" * 32)
    adm = Admission(KeptLabelled(), METRICS)
    reserved = adm.admit(key, 100, 0.0)
    kept = adm.buckets[key.digest]
    for i in range(1, 50):
        adm.admit(key, 0, float(i), take=False)
        reserved = adm.admit(key, 100, float(i))
        adm.settle(key, reserved, 40, float(i) + 0.5)
        assert adm.buckets[key.digest] is kept
    b = adm.buckets[key.digest]
    assert b.requests is not None and b.tokens is not None
    assert b.requests.at == 49.0 and b.tokens.at == 49.5
