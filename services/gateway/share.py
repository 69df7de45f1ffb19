"""What the gateways of one plane share over the broker: the keys' limits, the load of
each replica, the cache knowledge of the prefix rule, and the requests waiting per model.

Used by `services.gateway.server` when it has a broker connection and sharing is on
(`--no-share` turns it off). Every `--share-interval` (50 ms) while what it says has
changed, and at least every fifth of `--share-expiry` (0.1 s) while it has not, each
gateway publishes a `schemas.share.Share` on core NATS (`subjects.share_subject`: never
stored): its requests in flight per replica, its uncached prefill work in flight, its
held requests per model, the keys it refused since, and the tokens of keys' limits it
hands to others; and a `schemas.share.Routed` batch of the blocks it routed where, sent
as soon as the loop's turn that routed them is done. A gateway that hears no other says
its state at its heartbeat alone, and routes no blocks to tell (`Cache.listeners`):
nobody reads them, and a gateway that joins is told the state at once. A gateway silent
for `--share-expiry` (0.5 s) is gone, as is one that says it leaves: what it said is dropped
and its share of every key's limits returns to the others (docs/gateway.md, "Several
gateways").

Limits, counters on a subject rather than a KV bucket (measured: tests/bench/
bench_gateways.py): each gateway holds a share of each key's limits, the limits over the
live gateways (`ratelimit.share`), and admits on it alone, with no round trip. A gateway
that refuses a key says so, and every other one that is not short of it hands it half of
what its share holds (`Admission.give`); what is handed on leaves one bucket as it joins
another, so the shares together never admit more than the key's limit. The slack: a
gateway joining while the others have spent their shares starts with a full share of
its own (at most a key's limit over the gateways, once per join), and a refusal's
Retry-After counts the share's refill, not the whole key's.

Load and demand: the others' counts, summed (`shared.Remote`), are what the rule adds to
its own for a pick (`shared.FleetPicker`), and what a `model.demanded` adds to this
gateway's own; of the gateways holding a model's requests, the one with the least id
reports them all (`reports`), the others none, so each waiting request is counted once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import nats.errors

from schemas import share as schema
from schemas import subjects
from services.gateway.admission import Admission
from services.gateway.keys import Key, Keys
from services.gateway.listen import SHARE_EXPIRY_S, SHARE_INTERVAL_S
from services.gateway.shared import Cache, FleetPicker, Remote
from services.gateway.waiting import WaitingRoom

log = logging.getLogger("llmgw.gateway")

# INTERVAL_S is how often a gateway says its state: the bound on how stale another's
# counts are (plus the broker's hop, well under a millisecond on one network). 20
# messages a second a gateway, each read by every other: 8 gateways, 1,120 a second.
# EXPIRY_S is how long a gateway may be silent before its share returns to the others:
# ten intervals (a loaded loop is late by tens of milliseconds, not by half a second).
INTERVAL_S = SHARE_INTERVAL_S
EXPIRY_S = SHARE_EXPIRY_S
# HEARTBEATS is how many messages a gateway whose counts have not changed sends per
# expiry (at most one an interval): enough to stay among the others, without the 20 a
# second (each one a write, and a wake of every gateway that reads it, its own too) of
# an idle gateway saying again what it said.
HEARTBEATS = 5
# GIVE is the part of its share a gateway hands to one that refused the key.
GIVE = 0.5
# MAX_PEERS bounds the gateways one keeps state of (a flood of ids keeps no more).
MAX_PEERS = 1000
# DELAYS is how many of the last messages' delays are kept for /health.
DELAYS = 1000


# TIMER_SLACK_S is how long past its heartbeat a lone gateway's loop wakes (`_pause`).
TIMER_SLACK_S = 0.002


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


def tag(digest: bytes) -> str:
    """A key's name between gateways: derived from its digest, never the key nor the
    digest the gateway looks keys up by."""
    return hashlib.sha256(b"llmgw share\x00" + digest).hexdigest()[:16]


@dataclass(eq=False)
class Sharing:
    """This gateway's side of the sharing (the module docstring)."""

    gateway: str
    nc: Any
    root: str
    admission: Admission
    picker: FleetPicker
    room: WaitingRoom
    keys: Keys | None = None
    interval_s: float = INTERVAL_S
    expiry_s: float = EXPIRY_S
    clock: Callable[[], float] = time.monotonic
    """The limits' clock (the gateway's `clock`)."""
    remote: Remote = field(default_factory=Remote)
    cache: Cache | None = None
    peers: dict[str, float] = field(default_factory=dict)
    """The other gateways, by id: when each was last heard (monotonic seconds)."""
    states: dict[str, schema.Share] = field(default_factory=dict)
    delays: deque[float] = field(default_factory=lambda: deque(maxlen=DELAYS))
    """Seconds from a message's sending to its reading (on one host's clock)."""
    gives: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    _keys: dict[str, Key] = field(default_factory=dict)
    _wanted: dict[bytes, float] = field(default_factory=dict)
    _subs: list[Any] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    _said: tuple[Any, ...] | None = None
    """The counts the last message said (`_publish`)."""
    _said_at: float = float("-inf")
    _news: bool = True
    """A gateway joined since the last message: the next one goes whatever it says."""

    def __post_init__(self) -> None:
        if self.keys is not None:
            self._keys = {tag(k.digest): k for k in self.keys}
        self.admission.gateways = self.gateways
        self.admission.wanted = self.nudge
        self._woken: asyncio.Future[None] | None = None
        self._lone = False
        if self.cache is not None:
            self.cache.on_routed = self._routed_soon
            self.cache.listeners = self.peers  # told while another gateway is heard
        self._cache_due: asyncio.Task[None] | None = None

    def _routed_soon(self) -> None:
        """Blocks were routed: told to the others once this turn of the loop is done (a
        conversation's next turn may come through another gateway a moment later)."""
        if self._cache_due is None and self._task is not None:
            self._cache_due = asyncio.get_running_loop().create_task(self._tell_cache())

    async def _tell_cache(self) -> None:
        try:
            await self._publish_cache()
        except nats.errors.Error as e:
            log.debug("gateway: blocks not sent: %s", e)
        finally:
            self._cache_due = None

    async def _publish_cache(self) -> None:
        if self.cache is None:
            return
        blocks = self.cache.batch()
        if blocks:
            batch = schema.Routed(gateway=self.gateway, blocks=blocks)
            await self.nc.publish(
                subjects.cache_subject(self.gateway, self.root), schema.encode(batch)
            )

    # ------------------------------------------------------------------ reading

    def gateways(self) -> int:
        """The gateways sharing now, this one included."""
        return 1 + len(self.peers)

    def waiting(self, model: str) -> int:
        return sum(s.waiting.get(model, 0) for s in self.states.values())

    def reports(self, model: str, waiting: int) -> bool:
        holding = [g for g, s in self.states.items() if s.waiting.get(model, 0)]
        if not waiting:
            return not holding
        return all(self.gateway < g for g in holding)

    def inflight(self) -> Mapping[str, int]:
        return self.remote.inflight

    def held_by_owner(self, model: str) -> dict[str | None, int]:
        out: dict[str | None, int] = {}
        for s in self.states.values():
            for o, n in s.owners.get(model, {}).items():
                out[o or None] = out.get(o or None, 0) + n
        return out

    def said(self) -> dict[str, Any]:
        """For /health: the gateways sharing, and the delay of their counts (ms)."""
        d = sorted(self.delays)
        delay = (
            {
                "p50": round(statistics.median(d) * 1000, 2),
                "p99": round(d[min(len(d) - 1, int(len(d) * 0.99))] * 1000, 2),
            }
            if d
            else None
        )
        return {
            "gateways": self.gateways(),
            "peers": sorted(self.peers),
            "interval_ms": round(self.interval_s * 1000, 1),
            "delay_ms": delay,
            "remote_inflight": dict(self.remote.inflight),
            "remote_waiting": {m: self.waiting(m) for s in self.states.values() for m in s.waiting},
            "cache_taught": self.cache.taught if self.cache is not None else 0,
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Listen, say this gateway's state, and wait three intervals for the others'
        (so that the keys' shares are known before the first request)."""
        self._subs.append(
            await self.nc.subscribe(subjects.share_wildcard(self.root), cb=self._heard)
        )
        if self.cache is not None:
            self._subs.append(
                await self.nc.subscribe(subjects.cache_wildcard(self.root), cb=self._routed)
            )
        self._task = asyncio.create_task(self._loop(), name="gateway: share")
        await asyncio.sleep(3 * self.interval_s)

    async def stop(self) -> None:
        """Say this gateway leaves (its shares return to the others at once), stop."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            bye = schema.Share(gateway=self.gateway, at=time.time(), leaving=True)
            await self.nc.publish(
                subjects.share_subject(self.gateway, self.root), schema.encode(bye)
            )
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()

    async def _loop(self) -> None:
        said: set[str] = set()
        while True:
            try:
                self._expire(self.clock())
                await self._publish()
            except nats.errors.Error as e:
                log.debug("gateway: share not sent: %s", e)
            except Exception as e:  # one line a kind of fault, and the sharing goes on
                if type(e).__name__ not in said:
                    said.add(type(e).__name__)
                    log.exception("gateway: share not sent")
            await self._pause()

    async def _pause(self) -> None:
        """Until the next turn: an interval while another gateway is heard (what it reads
        is said as it changes), or while something is still to say; a lone gateway's
        counts are said to nobody, so it sleeps until its heartbeat is due, unless a
        gateway joins or a key is refused first (`nudge`)."""
        wait = self.interval_s
        lone = not (self.peers or self._news or self.gives or self.admission.wanting)
        if lone:
            # Until the heartbeat is due, and a little past (a timer may fire a
            # millisecond early: uvloop's count whole ones, and the turn would then find
            # it not due and wait an interval more); an interval when it is overdue (its
            # message was not sent: tried again at the interval's pace).
            due = self._said_at + self.heartbeat_s - self.clock()
            if due > 0:
                wait = min(due, self.heartbeat_s) + TIMER_SLACK_S
        loop = asyncio.get_running_loop()
        self._woken = woken = loop.create_future()
        self._lone = lone
        timer = loop.call_later(wait, _wake, woken)
        try:
            await woken
        finally:
            timer.cancel()
            self._woken = None

    def nudge(self) -> None:
        """Something to say (a gateway joined, a key was refused): a lone gateway
        sleeping until its heartbeat says it an interval after its last message, as one
        that is not lone does (never more often)."""
        woken = self._woken
        if woken is None or woken.done() or not self._lone:
            return
        self._lone = False  # one early turn is enough
        loop = asyncio.get_running_loop()
        after = self._said_at + self.interval_s - self.clock()
        loop.call_later(max(0.0, after), _wake, woken)

    @property
    def heartbeat_s(self) -> float:
        """The longest a gateway whose counts do not change goes without saying them."""
        return max(self.interval_s, self.expiry_s / HEARTBEATS)

    async def _publish(self) -> None:
        """This gateway's state to the others: each interval while its counts change
        (and another gateway is there to read them), or it wants or hands on some of a
        key's limits, or another gateway has joined; else once a `heartbeat_s`."""
        wanted = self.admission.wanting
        now = self.clock()
        room = self.room
        said = (
            {r: n for r, n in self.picker.inflight.items() if n > 0},
            dict(self.picker.work_of()),
            room.held_by_model(),
            room.held_by_owner(),
        )
        if (
            not wanted
            and not self.gives
            and not self._news
            and (said == self._said or not self.peers)
            and now - self._said_at < self.heartbeat_s
        ):
            await self._publish_cache()
            return
        for digest in wanted:
            self._wanted[digest] = now
        want = tuple(tag(d) for d in wanted)
        wanted.clear()
        gives = {g: {t: (r, k) for t, (r, k) in given.items()} for g, given in self.gives.items()}
        self.gives.clear()
        self._said, self._said_at, self._news = said, now, False
        inflight, work, waiting, owners = said
        msg = schema.Share(
            gateway=self.gateway,
            at=time.time(),
            inflight=inflight,
            work=work,
            waiting=waiting,
            owners=owners,
            want=want,
            gives=gives,
        )
        await self.nc.publish(subjects.share_subject(self.gateway, self.root), schema.encode(msg))
        await self._publish_cache()

    # ------------------------------------------------------------------ hearing

    def _expire(self, now: float) -> None:
        for g in [g for g, t in self.peers.items() if now - t > self.expiry_s]:
            self._drop(g)

    def _drop(self, g: str) -> None:
        self.peers.pop(g, None)
        old = self.states.pop(g, None)
        if old is not None:
            self._apply(old, -1)
        self.gives.pop(g, None)

    def _apply(self, s: schema.Share, sign: int) -> None:
        """`s`'s counts added to the others' sums (`sign` 1) or taken out (-1)."""
        inflight, work = self.remote.inflight, self.remote.work
        for rid, n in s.inflight.items():
            left = inflight.get(rid, 0) + sign * n
            if left > 0:
                inflight[rid] = left
            else:
                inflight.pop(rid, None)
        for rid, w in s.work.items():
            got = work.get(rid, 0.0) + sign * w
            if got > 1e-6:
                work[rid] = got
            else:
                work.pop(rid, None)

    async def _heard(self, msg: Any) -> None:
        s = schema.decode_share(msg.data)
        if s is None or s.gateway == self.gateway:
            return
        if msg.subject != subjects.share_subject(s.gateway, self.root):
            return  # one on another's subject counts for nobody
        if s.leaving:
            self._drop(s.gateway)
            return
        now = self.clock()
        if s.gateway not in self.peers:
            if len(self.peers) >= MAX_PEERS:
                return
            self._news = True  # a newcomer hears this gateway at its next turn
            self.nudge()
        if s.at > 0:
            self.delays.append(max(0.0, time.time() - s.at))
        self.peers[s.gateway] = now
        old = self.states.get(s.gateway)
        if old is not None:
            self._apply(old, -1)
        self._apply(s, 1)
        self.states[s.gateway] = s
        self._limits(s, now)

    def _limits(self, s: schema.Share, now: float) -> None:
        """Hand `s`'s gateway some of the keys it refused; take what it handed this one."""
        for t, (r, k) in s.gives.get(self.gateway, {}).items():
            key = self._keys.get(t)
            if key is not None:
                self.admission.receive(key, r, k, now)
        for t in s.want:
            key = self._keys.get(t)
            if key is None or key.digest in self.admission.wanting:
                continue
            last = self._wanted.get(key.digest)
            if last is not None and now - last < 2 * self.interval_s:
                continue  # short of it itself
            r, k = self.admission.give(key, GIVE, now)
            if r > 0 or k > 0:
                given = self.gives.setdefault(s.gateway, {}).setdefault(t, [0.0, 0.0])
                given[0] += r
                given[1] += k

    async def _routed(self, msg: Any) -> None:
        b = schema.decode_routed(msg.data)
        if b is None or b.gateway == self.gateway or self.cache is None:
            return
        if msg.subject != subjects.cache_subject(b.gateway, self.root):
            return
        self.cache.heard(b.blocks)


def wrap(router: Any) -> FleetPicker:
    """The gateway's routing rule, deciding on the fleet's load and cache knowledge."""
    return FleetPicker(router, Remote(), Cache())


def attach(gw: Any) -> Sharing | None:
    """The sharing of a gateway (`services.gateway.server.Gateway`) whose rule `wrap`
    wrapped; None for one that shares nothing."""
    router = gw.router
    if not isinstance(router, FleetPicker):
        return None
    s = Sharing(
        gw.id,
        gw.nc,
        gw.root,
        gw.admission,
        router,
        gw.room,
        gw.keys,
        gw.share_interval_s,
        gw.share_expiry_s,
        gw.clock,
        remote=router.remote,
        cache=router.cache,
    )
    gw.holding.fleet = s
    return s
