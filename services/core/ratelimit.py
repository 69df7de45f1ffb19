"""Limits per API key: requests a minute (`rpm`) and tokens a minute (`tpm`), as token
buckets.

Pure: a bucket is a frozen value, `now` is a parameter (seconds on any clock that does
not go back), and nothing is kept here between calls. The gateway
(`services.gateway.server`) holds one `Buckets` per key, asks `admit` before a request
is routed and `charge` once its answer said how many tokens it took.

The rule: each limit is a bucket that holds a minute's worth (`rpm` requests, `tpm`
tokens) and refills continuously at that rate, so a key may burst to its limit and then
goes at its rate. A request takes one from the request bucket, and is admitted only
while the token bucket holds at least one token. Its tokens are known only at its end
(prompt and completion, from the answer's `usage`), so they are charged then and may
take the token bucket below zero: a key that spent past its minute waits until the
refill has paid it back, which is what a limit by the minute means. A refused request
takes nothing from either bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """A key's limits; None: no such limit."""

    rpm: int | None = None
    tpm: int | None = None


@dataclass(frozen=True)
class Bucket:
    level: float
    """What it held at `at`; below zero when tokens were charged past what it held."""
    at: float


@dataclass(frozen=True)
class Buckets:
    """A key's two buckets; None before its first request (full)."""

    requests: Bucket | None = None
    tokens: Bucket | None = None


@dataclass(frozen=True)
class Admission:
    buckets: Buckets
    """The key's buckets after the request (what they were, when it is refused)."""
    over: str | None = None
    """None: admitted. "rpm" or "tpm": the limit it is over."""
    wait_s: float = 0.0
    """Refused: the seconds until that limit would admit it."""


def level(b: Bucket | None, per_minute: int, now: float) -> float:
    """What the bucket `b` of `per_minute` holds at `now`: full when it was never used,
    never more than a minute's worth."""
    if b is None:
        return float(per_minute)
    return min(float(per_minute), b.level + max(now - b.at, 0.0) * per_minute / 60.0)


def wait_s(held: float, per_minute: int, need: float = 1.0) -> float:
    """Seconds until a bucket of `per_minute` holding `held` holds `need`; inf with no
    refill (a limit of 0)."""
    if held >= need:
        return 0.0
    if per_minute <= 0:
        return math.inf
    return (need - held) * 60.0 / per_minute


def admit(limits: Limits, buckets: Buckets, now: float) -> Admission:
    """Whether a key with `limits` and `buckets` may send one more request at `now`."""
    requests = tokens = None
    if limits.rpm is not None:
        held = level(buckets.requests, limits.rpm, now)
        if held < 1.0:
            return Admission(buckets, "rpm", wait_s(held, limits.rpm))
        requests = Bucket(held - 1.0, now)
    if limits.tpm is not None:
        held = level(buckets.tokens, limits.tpm, now)
        if held < 1.0:
            return Admission(buckets, "tpm", wait_s(held, limits.tpm))
        tokens = Bucket(held, now)
    return Admission(Buckets(requests, tokens))


def charge(limits: Limits, buckets: Buckets, now: float, tokens: int) -> Buckets:
    """`buckets` once a request of the key took `tokens` (prompt and completion)."""
    if limits.tpm is None or tokens <= 0:
        return buckets
    held = level(buckets.tokens, limits.tpm, now)
    return Buckets(buckets.requests, Bucket(held - tokens, now))
