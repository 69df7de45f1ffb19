"""Who may send a request, and how much: the API keys, their limits, their owners.

Used by `services.gateway.server` for each request when the gateway has keys: a request
without a valid `Authorization: Bearer KEY` is 401; one over its key's rpm or tpm is
429, with Retry-After and the limit in words (`services.core.ratelimit`: the tokens a
request may take are reserved as it is admitted and settled to what it took as it
ends). A key whose owner the quota tree does not name stops the gateway at its start
(one line naming its FILE:LINE), and is said once in the log if a later tree leaves it
out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from services.core import ratelimit
from services.core.view import ViewState as State
from services.gateway.errors import GatewayError
from services.gateway.exchange import Request
from services.gateway.keys import Key, Keys
from services.gateway.metrics import NOT_READ, Labelled, Metrics
from services.gateway.refusal import Refusal
from services.gateway.request import MODEL

log = logging.getLogger("llmgw.gateway")

# SHUT_RETRY_S is the Retry-After of a key whose limit is 0 (it never refills).
SHUT_RETRY_S = 3600


def authorize(keys: Keys | None, request: Request) -> Key | None:
    """The request's key; None with no keys configured. 401 else."""
    if keys is None:
        return None
    key = keys.find(request.headers.get("Authorization"))
    if key is None:
        raise Refusal(401, "no valid API key: send Authorization: Bearer KEY", "invalid_api_key")
    return key


class Kept:
    """A key's two buckets as `ratelimit.Buckets` says them, kept and updated in place:
    what changes with each request (a level and its time) is written over, not made
    anew (the frozen `Buckets`, two `Bucket`s and an `Admission` a request made before).
    The same arithmetic as `ratelimit.admit` and `ratelimit.settle`, on floats; the rare
    turns (a refusal, a share given or received, a smaller share) go through
    `ratelimit` itself, from `frozen` and back with `thaw`. `requests` and `tokens` read
    as `ratelimit.Buckets`' do; equal when the buckets are."""

    __slots__ = ("rq", "rq_at", "tk", "tk_at")

    def __init__(self) -> None:
        # None: never used (full), as a `Buckets`' None.
        self.rq: float | None = None
        self.rq_at = 0.0
        self.tk: float | None = None
        self.tk_at = 0.0

    @property
    def requests(self) -> ratelimit.Bucket | None:
        return None if self.rq is None else ratelimit.Bucket(self.rq, self.rq_at)

    @property
    def tokens(self) -> ratelimit.Bucket | None:
        return None if self.tk is None else ratelimit.Bucket(self.tk, self.tk_at)

    def frozen(self) -> ratelimit.Buckets:
        return ratelimit.Buckets(self.requests, self.tokens)

    def thaw(self, b: ratelimit.Buckets) -> Kept:
        rq, tk = b.requests, b.tokens
        self.rq, self.rq_at = (None, 0.0) if rq is None else (rq.level, rq.at)
        self.tk, self.tk_at = (None, 0.0) if tk is None else (tk.level, tk.at)
        return self

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Kept):
            other = other.frozen()
        if not isinstance(other, ratelimit.Buckets):
            return NotImplemented
        return self.frozen() == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Kept({self.frozen()!r})"


def _level(held: float | None, at: float, per_minute: float, now: float) -> float:
    """`ratelimit.level` of a kept bucket."""
    if held is None:
        return float(per_minute)
    if held >= per_minute:
        return held
    # `min` and `max` as conditionals (each of theirs parses its keywords in this Python:
    # a score of calls a request), the same value: min(a, b) is b only where b < a.
    since = now - at
    level = held + (0.0 if since < 0.0 else since) * per_minute / 60.0
    return level if level < per_minute else float(per_minute)


@dataclass(eq=False)
class Admission:
    """Each limited key's buckets (by digest; bounded by the key file), and what was last
    said of the keys' owners.

    With `gateways` (`services.gateway.share`), the buckets hold this gateway's share of
    each key's limits, the limits over the gateways live now (`ratelimit.share`), cut to
    it as gateways join; a key refused is said in `wanting`, for the others to hand
    this one some of theirs (`give`, `receive`)."""

    labelled: Labelled
    metrics: Metrics
    buckets: dict[bytes, Kept] = field(default_factory=dict)
    gateways: Callable[[], int] | None = None
    """How many gateways share the keys' limits now, this one included; None: alone."""
    wanting: set[bytes] = field(default_factory=set)
    """Keys (digests) refused since the others were last told."""
    wanted: Callable[[], None] | None = None
    """Called as a key is added to `wanting` (the sharing's `nudge`: a lone gateway says
    it at once, not at its heartbeat)."""
    _shared_by: int = 1
    _limits: dict[bytes, ratelimit.Limits] = field(default_factory=dict)
    _shares: dict[bytes, tuple[ratelimit.Limits, ratelimit.Limits]] = field(default_factory=dict)
    """Each key's whole limits and this gateway's share of them while `_shared_by` holds."""
    _owners_seen: tuple[Any, ...] | None = None
    _owners_said: str | None = None

    def share_of(self, limits: ratelimit.Limits, now: float) -> ratelimit.Limits:
        """This gateway's share of `limits` now; the buckets cut to a smaller share as
        gateways join."""
        return ratelimit.share(limits, self._sharing(now))

    def _sharing(self, now: float) -> int:
        """How many gateways share the limits now; the buckets cut to a smaller share as
        gateways join."""
        n = 1 if self.gateways is None else max(1, self.gateways())
        if n != self._shared_by:
            grew = n > self._shared_by
            self._shared_by = n
            self._shares.clear()
            if grew:
                for digest, whole in self._limits.items():
                    b = self.buckets.get(digest)
                    if b is not None:
                        b.thaw(ratelimit.clip(ratelimit.share(whole, n), b.frozen(), now))
        return n

    def _share(self, key: Key, now: float) -> ratelimit.Limits:
        """`share_of` the key's whole limits, the share kept while the gateways are as
        many (not made anew for each request)."""
        whole = key.limits
        self._limits[key.digest] = whole
        gateways = self.gateways
        n = 1 if gateways is None else gateways()
        if n != self._shared_by:  # they changed (or `_sharing` says why not)
            n = self._sharing(now)
        if n == 1:
            return whole
        kept = self._shares.get(key.digest)
        if kept is not None and kept[0] is whole:
            return kept[1]
        limits = ratelimit.share(whole, n)
        self._shares[key.digest] = (whole, limits)
        return limits

    def _kept(self, digest: bytes) -> Kept:
        b = self.buckets.get(digest)
        if b is None:
            b = self.buckets[digest] = Kept()
        return b

    def give(self, key: Key, fraction: float, now: float) -> tuple[float, float]:
        """`fraction` of `key`'s share held now, taken out to hand to another gateway:
        the requests and tokens."""
        limits = key.limits
        if limits.rpm is None and limits.tpm is None:
            return 0.0, 0.0
        share = self._share(key, now)
        b = self._kept(key.digest)
        given, r, t = ratelimit.give(share, b.frozen(), now, fraction)
        b.thaw(given)
        return r, t

    def receive(self, key: Key, requests: float, tokens: float, now: float) -> None:
        """Another gateway handed this one `requests` and `tokens` of `key`'s limits."""
        share = self._share(key, now)
        b = self._kept(key.digest)
        b.thaw(ratelimit.receive(share, b.frozen(), now, requests, tokens))

    def admit(self, key: Key, reserve: int, now: float, take: bool = True) -> float:
        """One more request of `key`, which may take `reserve` tokens, taken by its
        limits at `now` (seconds): the tokens reserved for it (settled by `settle` at its
        end), or a 429 saying which limit and for how long. Not `take`: only whether its
        rpm refuses it (known before its body is read; what it may take of its tpm is
        not), its buckets left as they are.

        `ratelimit.admit` on the key's kept buckets, written over in place."""
        limits = key.limits
        rpm = limits.rpm
        tpm = limits.tpm if take else None
        if rpm is None and tpm is None:
            return 0.0
        if self.gateways is not None:
            limits = self._share(key, now)
            rpm = limits.rpm
            tpm = limits.tpm if take else None
        b = self.buckets.get(key.digest)
        if b is None:
            b = Kept()
        over = None
        wait = rq = tk = need = 0.0
        if rpm is not None:
            rq = _level(b.rq, b.rq_at, rpm, now)
            if rq < 1.0:
                over, wait = "rpm", ratelimit.wait_s(rq, rpm)
        if over is None and tpm is not None:
            tk = _level(b.tk, b.tk_at, tpm, now)
            asked, most = float(reserve), float(tpm)  # max(1, min(asked, most)), as `_level`
            need = most if most < asked else asked
            need = need if need > 1.0 else 1.0
            if tk < need:
                over, wait = "tpm", ratelimit.wait_s(tk, tpm, need)
            else:
                need = tk if tk < asked else asked
        if over is None:
            if take:
                if rpm is None:
                    b.rq, b.rq_at = None, 0.0
                else:
                    b.rq, b.rq_at = rq - 1.0, now
                if tpm is None:
                    b.tk, b.tk_at = None, 0.0
                else:
                    b.tk, b.tk_at = tk - need, now
                self.buckets[key.digest] = b
            return need
        self._refuse(key, over, wait)

    def early(self, request: Request, key: Key, now: float) -> None:
        """`admit`'s rpm alone, as before `request`'s body is read: a 429 is counted under
        no model (`NOT_READ`: none is read yet)."""
        try:
            self.admit(key, 0, now, take=False)
        except Refusal:
            request[MODEL] = NOT_READ
            raise

    def _refuse(self, key: Key, over: str, wait: float) -> NoReturn:
        if self.gateways is not None:
            self.wanting.add(key.digest)
            if self.wanted is not None:
                self.wanted()
        # A limit of 0 never refills: the key is shut, and told to come back in an hour.
        shut = not math.isfinite(wait)
        retry = SHUT_RETRY_S if shut else max(1, math.ceil(wait))
        limits = key.limits
        if over == "rpm":
            said, kind = f"its {limits.rpm} requests a minute (rpm={limits.rpm})", "requests"
        else:
            said, kind = f"its {limits.tpm} tokens a minute (tpm={limits.tpm})", "tokens"
        then = "it may send none" if shut else f"try again in {retry}s"
        words = f"the key of {key.owner} is over {said}; {then}"
        self.labelled.of(self.metrics.limited, key.owner, over).inc()
        raise Refusal(
            429,
            # The client is told its key's limit in words, never where the keys file is
            # on the gateway's host or which line of it is theirs.
            f"rate limit: {words}",
            "rate_limit_exceeded",
            kind=kind,
            headers={"Retry-After": str(retry)},
            words=words,
        )

    def settle(self, key: Key, reserved: float, took: int, now: float) -> None:
        """A request of `key` admitted with `reserved` tokens has ended having taken
        `took`: its key's token bucket settled to that (`ratelimit.settle`, in place)."""
        tpm = key.limits.tpm
        if tpm is None:
            return
        if self.gateways is not None:
            share = self._share(key, now).tpm
            assert share is not None
            tpm = share
        b = self._kept(key.digest)
        if reserved <= 0 and took <= 0:
            return
        held = _level(b.tk, b.tk_at, tpm, now)
        # max(tpm, held) and min(top, held + reserved - max(took, 0)), as `_level`.
        whole = float(tpm)
        top = held if held > whole else whole
        level = held + reserved - (0 if took < 0 else took)
        b.tk, b.tk_at = (level if level < top else top), now

    def check_owners(self, keys: Keys | None, state: State) -> None:
        """A key whose owner is not in the quota tree the log says (nor a declared
        model's owner) stops the gateway with one line naming its FILE:LINE."""
        if keys is None:
            return
        why = keys.outside({o.name for o in state.quota}, {m.owner for m in state.models.values()})
        if why is not None:
            raise GatewayError(why)
        self._owners_seen = (state.quota, len(state.models))

    def recheck_owners(self, keys: Keys | None, state: State) -> None:
        """Once the gateway serves, a quota tree that leaves a key's owner out is said
        once in the log (its requests are still served and counted for that owner)."""
        if keys is None:
            return
        seen = (state.quota, len(state.models))
        if seen == self._owners_seen:
            return
        self._owners_seen = seen
        why = keys.outside({o.name for o in state.quota}, {m.owner for m in state.models.values()})
        if why is not None and why != self._owners_said:
            log.warning("gateway: %s", why)
        self._owners_said = why
