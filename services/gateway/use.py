"""Use is a fact: what each replica served, read from the answers and reported.

Used by `services.gateway.server` (`Uses.used` as each answer ends, `Uses.report` while
it serves). For each replica it served, the gateway publishes `replica.used` with the
requests and tokens (from the answers' `usage`) since its last report, at most once per
`used_interval_s`, on the replica's node subject as its agent would, and per owner of the
API keys that sent them (`by_owner`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
import nats.errors

from schemas import events as ev
from services import clock
from services.bus import Publisher
from services.bus.errors import BusError
from services.clock import new_id, utc_now
from services.core.view import View
from services.gateway import guard
from services.gateway.keys import Key
from services.gateway.metrics import Labelled, Metrics

SOURCE = "gateway"
# USED_TICK_S is how often the reporter looks for use to report (the interval, when it
# is shorter).
USED_TICK_S = 1.0


class _Details(msgspec.Struct, forbid_unknown_fields=False):
    cached_tokens: int | None = None


class _Tokens(msgspec.Struct, forbid_unknown_fields=False):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Answer(msgspec.Struct, forbid_unknown_fields=False):
    """What use reports read of an answer: its `usage`, nothing else."""

    usage: _Tokens | None = None


_answer = msgspec.json.Decoder(_Answer)


def usage(doc: bytes) -> tuple[int, int]:
    """(prompt, completion) tokens an answer's `usage` says; (0, 0) when it says none."""
    prompt, completion, _ = use_of(doc)
    return prompt, completion


def cached(doc: bytes) -> int | None:
    """The prompt tokens an answer's `usage` says the engine served from its prefix
    cache (`prompt_tokens_details.cached_tokens`: vLLM with
    `--enable-prompt-tokens-details`); None when it does not say."""
    return use_of(doc)[2]


def use_of(doc: bytes) -> tuple[int, int, int | None]:
    """`usage` and `cached` of a whole answer, in one decode of it."""
    try:
        u = _answer.decode(doc).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0, 0, None
    if u is None:
        return 0, 0, None
    d = u.prompt_tokens_details
    # Each `max(n, 0)` as a conditional (`max` parses its keywords at each call here).
    saved = None if d is None or (k := d.cached_tokens) is None else (0 if k < 0 else k)
    p, c = u.prompt_tokens, u.completion_tokens
    return (0 if p < 0 else p), (0 if c < 0 else c), saved


def stream_cached(tail: bytes) -> int | None:
    """`cached` of a stream's last `data:` event with a usage."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line and b'"prompt_tokens"' in line:
            return cached(line[6:])
    return None


def stream_usage(tail: bytes) -> tuple[int, int] | None:
    """The usage of a stream's last `data:` event that has one (a client that asked for
    `stream_options.include_usage` gets such a chunk last); None without."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            got = usage(line[6:])
            if got != (0, 0):
                return got
    return None


def _owner_tokens(labelled: Labelled, tokens: Any, owner: str) -> tuple[Any, Any]:
    """`owner`'s tokens in and out (`Uses.used`)."""
    return labelled.of(tokens, owner, "in"), labelled.of(tokens, owner, "out")


@dataclass
class Use:
    """Use of one replica not reported yet."""

    node: str
    at_s: float
    """When it last served (seconds since the epoch, `time.time()`: a float for each
    request, the report's time made from it once a report)."""
    requests: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    tokens_cached: int | None = None
    """Of `tokens_in`, those the answers said were served from the prefix cache."""
    owners: dict[str, list[int]] = field(default_factory=dict)
    """Per owner of the keys that sent them: [requests, tokens_in, tokens_out]."""
    moved_to: dict[str, int] = field(default_factory=dict)
    """Streams moved off it, per replica they went to (`services.gateway.continuation`)."""
    reported: float = -math.inf
    """When (monotonic) its last report was stored."""


@dataclass(eq=False)
class Uses:
    """The use not reported yet, per replica, and its reporter."""

    publisher: Publisher
    view: Callable[[], View]
    """The follower's view now (what tells a replica gone, whose entry is dropped)."""
    metrics: Metrics
    labelled: Labelled
    lines: guard.Lines
    interval_s: float
    pending: dict[str, Use] = field(default_factory=dict)

    def used(
        self,
        r: Any,
        tokens_in: int,
        tokens_out: int,
        key: Key | None,
        cached: int | None = None,
        requests: int = 1,
    ) -> None:
        """Count one request that `r` answered, sent with `key`, for its next report;
        `cached` of its prompt tokens the engine said it served from its prefix cache.
        `requests` 0: the part of a request that began on another replica and moved
        here (`services.gateway.continuation`), counted there."""
        u = self.pending.get(r.id)
        now = time.time()
        if u is None:
            u = self.pending[r.id] = Use(node=r.shards[0].node if r.shards else "", at_s=now)
        u.at_s, u.requests = now, u.requests + requests
        u.tokens_in += tokens_in
        u.tokens_out += tokens_out
        if cached is not None:
            u.tokens_cached = (u.tokens_cached or 0) + cached
        if key is None:
            return
        o = u.owners.setdefault(key.owner, [0, 0, 0])
        o[0] += requests
        o[1] += tokens_in
        o[2] += tokens_out
        labelled, k = self.labelled, ("owner tokens", key.owner)
        # Kept children, looked up with no function made for it (`group_of`).
        said_in, said_out = labelled.groups.get(k) or labelled.group_of(
            k, _owner_tokens, labelled, self.metrics.owner_tokens, key.owner
        )
        said_in.inc(tokens_in)
        said_out.inc(tokens_out)

    def moved(self, r: Any, to: str) -> None:
        """One stream moved off `r` to replica `to`, for `r`'s next report."""
        u = self.pending.get(r.id)
        if u is None:
            u = self.pending[r.id] = Use(
                node=r.shards[0].node if r.shards else "", at_s=time.time()
            )
        u.moved_to[to] = u.moved_to.get(to, 0) + 1

    async def report(self, stop: asyncio.Event, each: Callable[[], None]) -> None:
        """Publish what is due every tick until `stop`; `each` after every tick."""
        tick = min(self.interval_s, USED_TICK_S)
        while not stop.is_set():
            await clock.until(stop, tick)
            await self.publish()
            each()

    async def publish(self, force: bool = False) -> None:
        """One `replica.used` for each replica with use not reported, at most one per
        `interval_s` (unless `force`), on its node's subject like its agent's."""
        now_m = time.monotonic()
        for rid, u in list(self.pending.items()):
            if not u.node or not (u.requests or u.tokens_in or u.tokens_out or u.moved_to):
                continue
            if not force and now_m - u.reported < self.interval_s:
                continue
            await self._publish(rid, u)
        view = self.view()
        idle = [
            rid
            for rid, u in self.pending.items()
            if not (u.requests or u.tokens_in or u.tokens_out or u.moved_to)
        ]
        for rid in idle:
            r = view.replicas.get(rid)
            if r is None or not r.holds_capacity:
                del self.pending[rid]

    async def _publish(self, rid: str, u: Use) -> None:
        by_owner = {
            o: ev.OwnerUse(requests=n[0], tokens_in=n[1], tokens_out=n[2])
            for o, n in u.owners.items()
            if any(n)
        }
        e = ev.make(
            ev.ReplicaUsed(
                replica=rid,
                at=datetime.fromtimestamp(u.at_s, UTC),
                requests=u.requests,
                tokens_in=u.tokens_in,
                tokens_out=u.tokens_out,
                tokens_cached=u.tokens_cached,
                by_owner=by_owner,
                moved_to=dict(u.moved_to),
            ),
            id=new_id(),
            time=utc_now(),
            source=SOURCE,
        )
        sent = (u.requests, u.tokens_in, u.tokens_out)
        sent_cached = u.tokens_cached
        sent_moved = dict(u.moved_to)
        try:
            await self.publisher.publish(e, node=u.node)
        except (BusError, nats.errors.Error) as err:
            self.lines.say(
                logging.WARNING,
                ("use", rid),
                "gateway: use of %s not reported yet: %s",
                rid,
                err,
            )
            return
        # Requests that ended while it was being published are the next report's.
        u.requests -= sent[0]
        for to, k in sent_moved.items():
            left = u.moved_to[to] - k
            if left:
                u.moved_to[to] = left
            else:
                del u.moved_to[to]
        u.tokens_in -= sent[1]
        u.tokens_out -= sent[2]
        if sent_cached is not None and u.tokens_cached is not None:
            u.tokens_cached = u.tokens_cached - sent_cached if u.requests else None
        for o, d in by_owner.items():
            n = u.owners[o]
            n[0] -= d.requests
            n[1] -= d.tokens_in
            n[2] -= d.tokens_out
            if not any(n):
                del u.owners[o]
        u.reported = time.monotonic()
