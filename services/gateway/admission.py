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
from typing import Any

from aiohttp import web

from services.core import ratelimit
from services.core.view import ViewState as State
from services.gateway.errors import GatewayError
from services.gateway.keys import Key, Keys
from services.gateway.metrics import Labelled, Metrics
from services.gateway.refusal import Refusal

log = logging.getLogger("llmgw.gateway")

# SHUT_RETRY_S is the Retry-After of a key whose limit is 0 (it never refills).
SHUT_RETRY_S = 3600


def authorize(keys: Keys | None, request: web.Request) -> Key | None:
    """The request's key; None with no keys configured. 401 else."""
    if keys is None:
        return None
    key = keys.find(request.headers.get("Authorization"))
    if key is None:
        raise Refusal(401, "no valid API key: send Authorization: Bearer KEY", "invalid_api_key")
    return key


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
    buckets: dict[bytes, ratelimit.Buckets] = field(default_factory=dict)
    gateways: Callable[[], int] | None = None
    """How many gateways share the keys' limits now, this one included; None: alone."""
    wanting: set[bytes] = field(default_factory=set)
    """Keys (digests) refused since the others were last told."""
    _shared_by: int = 1
    _limits: dict[bytes, ratelimit.Limits] = field(default_factory=dict)
    _owners_seen: tuple[Any, ...] | None = None
    _owners_said: str | None = None

    def share_of(self, limits: ratelimit.Limits, now: float) -> ratelimit.Limits:
        """This gateway's share of `limits` now; the buckets cut to a smaller share as
        gateways join."""
        n = 1 if self.gateways is None else max(1, self.gateways())
        if n != self._shared_by:
            grew = n > self._shared_by
            self._shared_by = n
            if grew:
                for digest, whole in self._limits.items():
                    b = self.buckets.get(digest)
                    if b is not None:
                        self.buckets[digest] = ratelimit.clip(ratelimit.share(whole, n), b, now)
        return ratelimit.share(limits, n)

    def give(self, key: Key, fraction: float, now: float) -> tuple[float, float]:
        """`fraction` of `key`'s share held now, taken out to hand to another gateway:
        the requests and tokens."""
        limits = key.limits
        if limits.rpm is None and limits.tpm is None:
            return 0.0, 0.0
        share = self.share_of(limits, now)
        self._limits[key.digest] = limits
        b = self.buckets.get(key.digest, ratelimit.Buckets())
        b, r, t = ratelimit.give(share, b, now, fraction)
        self.buckets[key.digest] = b
        return r, t

    def receive(self, key: Key, requests: float, tokens: float, now: float) -> None:
        """Another gateway handed this one `requests` and `tokens` of `key`'s limits."""
        share = self.share_of(key.limits, now)
        self._limits[key.digest] = key.limits
        b = self.buckets.get(key.digest, ratelimit.Buckets())
        self.buckets[key.digest] = ratelimit.receive(share, b, now, requests, tokens)

    def admit(self, key: Key, reserve: int, now: float, take: bool = True) -> float:
        """One more request of `key`, which may take `reserve` tokens, taken by its
        limits at `now` (seconds): the tokens reserved for it (settled by `settle` at its
        end), or a 429 saying which limit and for how long. Not `take`: only whether its
        rpm refuses it (known before its body is read; what it may take of its tpm is
        not), its buckets left as they are."""
        limits = key.limits if take else ratelimit.Limits(rpm=key.limits.rpm)
        if limits.rpm is None and limits.tpm is None:
            return 0.0
        if self.gateways is not None:
            self._limits[key.digest] = key.limits
            limits = self.share_of(limits, now)
        a = ratelimit.admit(
            limits,
            self.buckets.get(key.digest, ratelimit.Buckets()),
            now,
            reserve if limits.tpm is not None else 0,
        )
        if a.over is None:
            if take:
                self.buckets[key.digest] = a.buckets
            return a.reserved
        if self.gateways is not None:
            self.wanting.add(key.digest)
        # A limit of 0 never refills: the key is shut, and told to come back in an hour.
        shut = not math.isfinite(a.wait_s)
        retry = SHUT_RETRY_S if shut else max(1, math.ceil(a.wait_s))
        limits = key.limits
        if a.over == "rpm":
            said, kind = f"its {limits.rpm} requests a minute (rpm={limits.rpm})", "requests"
        else:
            said, kind = f"its {limits.tpm} tokens a minute (tpm={limits.tpm})", "tokens"
        then = "it may send none" if shut else f"try again in {retry}s"
        words = f"the key of {key.owner} is over {said}; {then}"
        self.labelled.of(self.metrics.limited, key.owner, a.over).inc()
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
        `took`: its key's token bucket settled to that."""
        if key.limits.tpm is None:
            return
        limits = key.limits if self.gateways is None else self.share_of(key.limits, now)
        b = self.buckets.get(key.digest, ratelimit.Buckets())
        self.buckets[key.digest] = ratelimit.settle(limits, b, now, reserved, took)

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
