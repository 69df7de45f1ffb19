"""Limits per API key: requests a minute (`rpm`) and tokens a minute (`tpm`), as token
buckets.

Pure: a bucket is a frozen value, `now` is a parameter (seconds on any clock that does
not go back), and nothing is kept here between calls. The gateway
(`services.gateway.server`) holds one `Buckets` per key, asks `admit` before a request
is routed and `charge` once its answer said how many tokens it took.

The rule: each limit is a bucket that holds a minute's worth (`rpm` requests, `tpm`
tokens) and refills continuously at that rate, so a key may burst to its limit and then
goes at its rate. A request takes one from the request bucket. Its tokens are known
only at its end (prompt and completion, from the answer's `usage`), so it is admitted on
what it may take, as Azure OpenAI counts a deployment's TPM: the gateway asks `admit`
with a reservation (the request's `max_tokens`, or DEFAULT_MAX_TOKENS, plus an estimate
of its prompt), admitted only while the token bucket holds it (at most a minute's worth:
a request larger than the minute needs the bucket full) and taken from the bucket at
once, so requests sent together cannot each spend the same minute. At its end `settle`
gives the reservation back and takes what it really took, which may take the bucket
below zero: a key that spent past its minute waits until the refill has paid it back,
which is what a limit by the minute means. A refused request takes nothing from either
bucket.

Several gateways (`services.gateway.share`): each holds a share of a key's limits
(`share`: the limits over the live gateways, a bucket that holds and refills that
share), and hands what it does not need to one that refuses the key's requests
(`give`, `receive`). What is handed on leaves one bucket as it joins another, so the
shares together never hold more than the key's minute: a bucket may hold more than its
share's minute when given it (it then refills no more until it is below), and a
gateway's bucket is cut to its share when gateways join (`clip`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# DEFAULT_MAX_TOKENS is what a request that names no `max_tokens` (nor
# `max_completion_tokens`) is taken to ask for when its key has a `tpm`: what a
# reservation holds until its answer says what it took (then settled to that).
DEFAULT_MAX_TOKENS = 1024


@dataclass(frozen=True)
class Limits:
    """A key's limits; None: no such limit."""

    rpm: float | None = None
    tpm: float | None = None


def share(limits: Limits, gateways: int) -> Limits:
    """One of `gateways` gateways' share of `limits`: each a part as large, refilled as
    fast."""
    n = max(1, gateways)
    if n == 1:
        return limits
    return Limits(
        rpm=None if limits.rpm is None else limits.rpm / n,
        tpm=None if limits.tpm is None else limits.tpm / n,
    )


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
    reserved: float = 0.0
    """Admitted: the tokens taken from the token bucket for it, given back by `settle`."""


def level(b: Bucket | None, per_minute: float, now: float) -> float:
    """What the bucket `b` of `per_minute` holds at `now`: full when it was never used,
    refilled to no more than a minute's worth (what it was given past that, it keeps)."""
    if b is None:
        return float(per_minute)
    if b.level >= per_minute:
        return b.level
    return min(float(per_minute), b.level + max(now - b.at, 0.0) * per_minute / 60.0)


def wait_s(held: float, per_minute: float, need: float = 1.0) -> float:
    """Seconds until a bucket of `per_minute` holding `held` holds `need`; inf with no
    refill (a limit of 0)."""
    if held >= need:
        return 0.0
    if per_minute <= 0:
        return math.inf
    return (need - held) * 60.0 / per_minute


def admit(limits: Limits, buckets: Buckets, now: float, reserve: int = 0) -> Admission:
    """Whether a key with `limits` and `buckets` may send one more request at `now` that
    may take `reserve` tokens: the token bucket must hold that much (at least one token,
    at most a minute's worth), and it is taken from it until `settle`."""
    requests = tokens = None
    need = 0.0
    if limits.rpm is not None:
        held = level(buckets.requests, limits.rpm, now)
        if held < 1.0:
            return Admission(buckets, "rpm", wait_s(held, limits.rpm))
        requests = Bucket(held - 1.0, now)
    if limits.tpm is not None:
        held = level(buckets.tokens, limits.tpm, now)
        need = max(1.0, min(float(reserve), float(limits.tpm)))
        if held < need:
            return Admission(buckets, "tpm", wait_s(held, limits.tpm, need))
        need = min(float(reserve), held)
        tokens = Bucket(held - need, now)
    return Admission(Buckets(requests, tokens), reserved=need)


def settle(limits: Limits, buckets: Buckets, now: float, reserved: float, tokens: int) -> Buckets:
    """`buckets` once a request admitted with `reserved` tokens ended having taken
    `tokens`: the reservation given back, the tokens taken (never above a minute's worth)."""
    if limits.tpm is None or (reserved <= 0 and tokens <= 0):
        return buckets
    held = level(buckets.tokens, limits.tpm, now)
    top = max(float(limits.tpm), held)
    return Buckets(buckets.requests, Bucket(min(top, held + reserved - max(tokens, 0)), now))


def charge(limits: Limits, buckets: Buckets, now: float, tokens: int) -> Buckets:
    """`buckets` once a request of the key took `tokens` (prompt and completion)."""
    if limits.tpm is None or tokens <= 0:
        return buckets
    held = level(buckets.tokens, limits.tpm, now)
    return Buckets(buckets.requests, Bucket(held - tokens, now))


def give(
    limits: Limits, buckets: Buckets, now: float, fraction: float
) -> tuple[Buckets, float, float]:
    """`fraction` of what each of the buckets holds at `now` (none of a bucket at or below
    zero), taken out to be handed to another gateway: the buckets left, and the requests
    and tokens taken."""
    requests, tokens = buckets.requests, buckets.tokens
    r = t = 0.0
    if limits.rpm is not None:
        held = level(requests, limits.rpm, now)
        r = max(0.0, held * fraction)
        requests = Bucket(held - r, now)
    if limits.tpm is not None:
        held = level(tokens, limits.tpm, now)
        t = max(0.0, held * fraction)
        tokens = Bucket(held - t, now)
    return Buckets(requests, tokens), r, t


def receive(
    limits: Limits, buckets: Buckets, now: float, requests: float, tokens: float
) -> Buckets:
    """`buckets` once another gateway handed them `requests` and `tokens` of the key's
    limits (kept even past a minute's worth of the share: they left another's bucket)."""
    rq, tk = buckets.requests, buckets.tokens
    if limits.rpm is not None and requests > 0:
        rq = Bucket(level(rq, limits.rpm, now) + requests, now)
    if limits.tpm is not None and tokens > 0:
        tk = Bucket(level(tk, limits.tpm, now) + tokens, now)
    return Buckets(rq, tk)


def clip(limits: Limits, buckets: Buckets, now: float) -> Buckets:
    """`buckets` held to a minute's worth of `limits` (a smaller share, as gateways
    join)."""
    rq, tk = buckets.requests, buckets.tokens
    if limits.rpm is not None and rq is not None:
        rq = Bucket(min(level(rq, limits.rpm, now), float(limits.rpm)), now)
    if limits.tpm is not None and tk is not None:
        tk = Bucket(min(level(tk, limits.tpm, now), float(limits.tpm)), now)
    return Buckets(rq, tk)
