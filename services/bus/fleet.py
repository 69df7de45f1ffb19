"""The gateways' fleet: each gateway announces itself, and anyone may know who is live.

Core NATS, never stored (`schemas.fleet`, docs/contract.md "The gateways'
announcements"): a gateway publishes its `GatewayAnnouncement` (id, address, routing
rule, start, pid and host, load) on `<root>.fleet.gateway.<id>` every `EVERY_S`, and one
with `leaving` set as it stops cleanly. A reader subscribes to them all and keeps a
`services.core.fleet.Roster`: a gateway silent for `EXPIRE_S` (killed, frozen, cut off)
is out of the fleet within that, one that says goodbye at once. A reader that has just
begun listening asks for a roll call (`<root>.fleet.rollcall`), and every gateway
announces itself at once, so that `llmgw get gateways` need not wait a whole interval.

Heartbeats on a subject rather than a KV bucket with a TTL: the bucket would write every
heartbeat to the store, and to each of its copies in a cluster, to keep what is only
chatter (4 writes a second a gateway), and a reader would still keep its own clock to
see a silent one within a second. The agents' liveness is said the same way
(`<root>.heartbeat.<node>`), and nothing of it is kept anywhere but in the readers.

    fleet = Fleet(nc, root, me=lambda: announcement, on_change=print)
    await fleet.start()
    fleet.live()   # {id: GatewayAnnouncement}, this gateway's own included
    await fleet.stop()  # says goodbye (when `me`), stops listening
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import nats.errors

from schemas import fleet as schema
from schemas import subjects
from schemas.fleet import GatewayAnnouncement, ModelLoad
from services.core.fleet import EVERY_S, EXPIRE_S, Roster

__all__ = ["EVERY_S", "EXPIRE_S", "Fleet", "GatewayAnnouncement", "ModelLoad", "Traffic"]

log = logging.getLogger("llmgw.gateway.fleet")

# ROLLCALL_S is the least time between two announcements a gateway makes for roll calls:
# a reader flooding roll calls gets one announcement a gateway per this, not one each.
ROLLCALL_S = 0.05
# SETTLE_S is how long `settled` waits after a roll call for the gateways' answers: they
# answer within a millisecond or two on one network; a loaded one within tens.
SETTLE_S = 0.3


class Fleet:
    """The live gateways, as heard on the broker `nc` under `root`.

    `me`, for a gateway: what it says of itself now (called at each announcement); then
    it announces itself every `every_s`, answers roll calls, says goodbye in `stop`, and
    `live()` includes it from `start` on. `on_change`, called with `live()` whenever a
    gateway joins, leaves or falls silent (not when only its load changes). `rollcall`
    False: it asks for no roll call at its start (an agent, whose role may not publish
    there, learns the fleet from the announcements within an interval)."""

    def __init__(
        self,
        nc: Any,
        root: str = subjects.DEFAULT_ROOT,
        *,
        me: Callable[[], GatewayAnnouncement] | None = None,
        on_change: Callable[[dict[str, GatewayAnnouncement]], Any] | None = None,
        every_s: float = EVERY_S,
        expire_s: float = EXPIRE_S,
        clock: Callable[[], float] = time.monotonic,
        rollcall: bool = True,
    ) -> None:
        if every_s <= 0 or expire_s <= 0:
            raise ValueError("every_s and expire_s must be more than 0")
        self.nc = nc
        self.root = root
        self.me = me
        self.on_change = on_change
        self.every_s = every_s
        self.expire_s = expire_s
        self.clock = clock
        self.roster = Roster(expire_s)
        self.started_at: float | None = None
        self._subs: list[Any] = []
        self._task: asyncio.Task[None] | None = None
        self._last_rollcall = float("-inf")
        self._mine: str | None = None
        self._rollcall_at_start = rollcall
        self.heard_any = False
        """Whether it has heard any gateway (other than itself) since `start`: then an
        empty `live()` says that every gateway it knew is gone, not that it knows none."""

    # ------------------------------------------------------------------ reading

    def live(self) -> dict[str, GatewayAnnouncement]:
        """The gateways live now, by id (this one's own included, as it last said)."""
        self._expire()
        return self.roster.live()

    def knows(self) -> bool:
        """Whether it has listened long enough that a live gateway it has not heard of
        is none: a whole `expire_s` since `start` (a roll call's answers come sooner)."""
        return self.started_at is not None and self.clock() - self.started_at >= self.expire_s

    async def settled(self, wait_s: float = SETTLE_S) -> dict[str, GatewayAnnouncement]:
        """`live()` once the roll call `start` made has had `wait_s` to be answered."""
        if self.started_at is not None:
            left = self.started_at + wait_s - self.clock()
            if left > 0:
                await asyncio.sleep(left)
        return self.live()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Listen, ask for a roll call, and (with `me`) begin announcing."""
        self.started_at = self.clock()
        self._subs.append(
            await self.nc.subscribe(subjects.gateway_announce_wildcard(self.root), cb=self._heard)
        )
        if self.me is not None:
            self._subs.append(
                await self.nc.subscribe(
                    subjects.gateway_rollcall_subject(self.root), cb=self._rollcall
                )
            )
            await self._announce()
        if self._rollcall_at_start:
            with contextlib.suppress(nats.errors.Error):
                await self.nc.publish(subjects.gateway_rollcall_subject(self.root), b"")
        self._task = asyncio.create_task(self._beat(), name="gateway fleet")

    async def stop(self) -> None:
        """Stop announcing, say goodbye (with `me`), stop listening."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.me is not None and self._mine is not None:
            with contextlib.suppress(Exception):
                bye = self.me()
                bye = GatewayAnnouncement(**{**_fields(bye), "leaving": True, "inflight": 0})
                self.roster.heard(bye, self.clock())
                await self.nc.publish(
                    subjects.gateway_announce_subject(bye.gateway, self.root), schema.encode(bye)
                )
                async with asyncio.timeout(1.0):
                    await self.nc.flush()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()

    # ------------------------------------------------------------------ inside

    async def _beat(self) -> None:
        """Announce every `every_s` (with `me`), and expire the silent in between."""
        tick = min(self.every_s, self.expire_s / 4)
        next_announce = self.clock() + self.every_s
        while True:
            await asyncio.sleep(tick)
            if self.me is not None and self.clock() >= next_announce:
                next_announce = self.clock() + self.every_s
                await self._announce()
            self._expire()

    async def _announce(self) -> None:
        assert self.me is not None
        try:
            a = self.me()
        except Exception:
            log.exception("gateway fleet: the announcement could not be made")
            return
        self._mine = a.gateway
        self._take(a)
        try:
            await self.nc.publish(
                subjects.gateway_announce_subject(a.gateway, self.root), schema.encode(a)
            )
        except nats.errors.Error as e:
            # A missed announcement is what the lease is for: the next one may arrive.
            log.warning("gateway fleet: announcement not sent: %s", e)

    async def _rollcall(self, msg: Any) -> None:
        now = self.clock()
        if now - self._last_rollcall < ROLLCALL_S:
            return
        self._last_rollcall = now
        await self._announce()

    async def _heard(self, msg: Any) -> None:
        named = subjects.gateway_of_announcement(msg.subject)
        a = schema.decode(msg.data)
        if a is None or named != a.gateway or a.gateway == self._mine:
            return  # a stranger's, one on another's subject, or this gateway's own echo
        self.heard_any = True
        self._take(a)

    def _take(self, a: GatewayAnnouncement) -> None:
        if self.roster.heard(a, self.clock()):
            self._changed()

    def _expire(self) -> None:
        if self.roster.expire(self.clock()):
            self._changed()

    def _changed(self) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(self.roster.live())
        except Exception:
            log.exception("gateway fleet: on_change failed")


class Traffic:
    """The fleet's traffic per model, as a dashboard shows one gateway's
    (`services.dashboard.traffic`): requests per model since this reader began (each
    gateway's count, a gone one's last count kept, so that the sum only grows), and in
    flight and held per model now, over the live gateways."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._seen: dict[str, dict[str, int]] = {}
        """The live gateways' latest counts."""
        self._gone: dict[str, int] = {}
        """The gone ones' last counts, summed (bounded by the models)."""

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        live = self.fleet.live()
        for g in [g for g in self._seen if g not in live]:
            for m, n in self._seen.pop(g).items():
                self._gone[m] = self._gone.get(m, 0) + n
        requests = dict(self._gone)
        inflight: dict[str, int] = {}
        for g, a in live.items():
            self._seen[g] = {m: load.requests for m, load in a.models.items()}
            for m, load in a.models.items():
                inflight[m] = inflight.get(m, 0) + load.inflight
                requests[m] = requests.get(m, 0) + load.requests
        return requests, inflight

    def held(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self.fleet.live().values():
            for m, load in a.models.items():
                out[m] = out.get(m, 0) + load.held
        return out


def _fields(a: GatewayAnnouncement) -> dict[str, Any]:
    return {f: getattr(a, f) for f in a.__struct_fields__}
