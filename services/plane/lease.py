"""Leadership: one active scheduler (or preemption service) at a time, by a lease in a
JetStream KV bucket.

Used by the scheduler and the preemption service: each runs `Lease.run(stop)` beside its
work and acts only while `is_leader` is true. The lease is a key (`name`) in a bucket
whose entries expire after `ttl_s` on the server; the holder renews it with a
compare-and-set (`update(last=rev)`) every ttl/3. A standby tries to create the key on the
same period and wins only once the key has expired or was released.

An entry's value is `<holder> <since>`: the holder's name, then when its term began (UTC,
ISO 8601), kept the same by every renewal of that term, so a reader (`llmgw status`, the
dashboard, `services.plane.liveness`) can say who leads and since when; the entry's own time
on the server says when it was last renewed. A value of the holder's name alone (what
older holders write) reads as a term of unknown start.

It must not decide anything: it only says who may. It never takes a key that holds a
live entry of another holder, and it never lets its holder believe it leads past the
moment a standby could take over.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from services.bus import stream
from services.bus.connection import Fault
from services.clock import utc_now

log = logging.getLogger("llmgw.lease")

DEFAULT_BUCKET = "llmgw_leases"

# SAFETY_FRACTION is the share of the TTL a holder gives up at the end of each term.
# The server starts the TTL when it stores the renewal, which is after the holder sent
# it; the holder counts from before it sent it and stops believing it leads this much
# earlier still, so a paused or partitioned leader stops publishing before a standby
# can take over, even with a slow clock or a late wake-up.
SAFETY_FRACTION = 0.2

# MIN_SAFETY_S floors the margin for short test TTLs, where a fifth of the TTL is less
# than one event-loop stall.
MIN_SAFETY_S = 0.1

OnChange = Callable[[bool], Awaitable[None] | None]


def encode_value(holder: str, since: datetime) -> bytes:
    """A lease entry's value: the holder, then when its term began."""
    return f"{holder} {since.isoformat()}".encode()


def decode_value(value: bytes | None) -> tuple[str | None, datetime | None]:
    """(holder, since) from a lease entry's value; since None when not recorded (an
    older holder's value, or one that does not parse)."""
    if not value:
        return None, None
    text = value.decode(errors="replace")
    holder, _, since = text.partition(" ")
    try:
        return holder, datetime.fromisoformat(since) if since else None
    except ValueError:
        return holder, None


async def ensure_bucket(
    js: JetStreamContext, bucket: str, ttl_s: float, replicas: int | None = None
) -> KeyValue:
    """The lease bucket, created if missing with `ttl_s` and `replicas` (see
    `stream.with_replicas`). `llmgw up` makes it first, with its `--replicas`; each lease
    makes it when it finds none."""
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        pass
    try:
        # In a cluster the bucket is replicated like the log: a lease that lived on one
        # server would make that server's death a control plane with no leader.
        return await stream.with_replicas(
            lambda r: js.create_key_value(
                KeyValueConfig(
                    bucket=bucket,
                    description="llmgw leader leases",
                    history=1,
                    ttl=ttl_s,
                    storage=StorageType.FILE,
                    replicas=r,
                )
            ),
            replicas,
        )
    except nats.js.errors.BadRequestError as e:
        # Another process created it between our look and our create; when it is not
        # there after all, the refusal was about something else and is the answer.
        try:
            return await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            raise e from None


class Lease:
    """One named lease, held by `holder` (unique per process) while renewed.

    `is_leader` is true only while the last successful acquire or renewal is recent
    enough that the key cannot yet have expired on the server. `on_change(leading)` is
    called on every change of that belief, including a lapse noticed by `run`.
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        name: str,
        holder: str,
        ttl_s: float = 5.0,
        bucket: str = DEFAULT_BUCKET,
        on_change: OnChange | None = None,
        clock: Callable[[], float] = time.monotonic,
        replicas: int | None = None,
        wall: Callable[[], datetime] = utc_now,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        self.js = js
        self.name = name
        self.holder = holder
        self.ttl_s = ttl_s
        self.bucket = bucket
        self.on_change = on_change
        self._clock = clock
        self._wall = wall
        self.replicas = replicas
        """Copies of the bucket when this lease creates it; None: 3 in a cluster, else 1."""
        self._kv: KeyValue | None = None
        self._rev: int | None = None
        """Revision of our own entry, while we hold the key."""
        self._deadline: float | None = None
        """Monotonic time until which we may believe we lead."""
        self.since: datetime | None = None
        """When this holder's term began (wall clock), while it holds the key."""
        self.failing_since: float | None = None
        """Monotonic time of the first of the attempts that have failed in a row (the
        broker unreachable, or refusing the write); None after one that worked."""
        self._reported = False
        self._fault = Fault(clock=clock)
        self.terms = 0
        """How many times this holder became leader."""

    # ------------------------------------------------------------------ reading

    @property
    def is_leader(self) -> bool:
        return self._deadline is not None and self._clock() < self._deadline

    @property
    def margin_s(self) -> float:
        return max(self.ttl_s * SAFETY_FRACTION, MIN_SAFETY_S)

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3

    def remaining_s(self) -> float:
        """Seconds this holder may still believe it leads; 0 when it does not."""
        if self._deadline is None:
            return 0.0
        return max(self._deadline - self._clock(), 0.0)

    async def current_holder(self) -> str | None:
        """Who holds the lease now, as the server says; None when nobody does."""
        kv = await self._bucket()
        try:
            entry = await kv.get(self.name)
        except nats.js.errors.KeyNotFoundError:
            return None
        return decode_value(entry.value)[0]

    # ------------------------------------------------------------------ acting

    async def acquire(self) -> bool:
        """Take the lease if it is free, renew it if it is ours; whether we now lead.

        A key held by someone else is left alone while it lives: the server removes it
        at its TTL (or its holder releases it), and only then may another create it.
        """
        started = self._clock()
        try:
            # Inside the try: a broker restarting as the lease first looks for its
            # bucket is unreachable like any other moment, not the end of the service.
            kv = await self._bucket()
            if self._rev is not None:
                since = self.since or self._wall()
                try:
                    self._rev = await kv.update(
                        self.name, encode_value(self.holder, since), last=self._rev
                    )
                except nats.js.errors.KeyWrongLastSequenceError:
                    # Our entry expired, or someone took the key after it did; only a
                    # create from scratch may tell which.
                    self._rev = None
            if self._rev is None:
                self._rev = await self._create(kv)
        except (nats.errors.Error, TimeoutError) as e:
            # Unreachable broker: keep the belief we have; the deadline ends it in time.
            # Said once, then once per period while it lasts (`Fault`), not every try.
            if self._fault.began():
                log.warning("lease %s: %s: %s", self.name, type(e).__name__, e)
            elif n := self._fault.due():
                log.warning(
                    "lease %s: still failing after %.0fs: %d attempt(s) since the last "
                    "line (%s: %s)",
                    self.name,
                    self._fault.lasted(),
                    n,
                    type(e).__name__,
                    e,
                )
            if self.failing_since is None:
                self.failing_since = started
            await self._report()
            return self.is_leader
        self.failing_since = None
        lasted = self._fault.ended()
        if lasted is not None:
            log.info("lease %s: the broker answers again after %.1fs", self.name, lasted)
        if self._rev is None:
            self._deadline = None
            self.since = None
        else:
            self._deadline = started + self.ttl_s - self.margin_s
        await self._report()
        return self.is_leader

    async def _create(self, kv: KeyValue) -> int | None:
        since = self._wall()
        try:
            rev = await kv.create(self.name, encode_value(self.holder, since))
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        else:
            self.since = since
            return rev
        # The key exists. It may still be ours: a restart with the same holder name, or a
        # renewal whose ack was lost. Then renew on its revision, in the same term.
        try:
            entry = await kv.get(self.name)
        except nats.js.errors.KeyNotFoundError:
            return None  # gone again in between; the next attempt may create it
        holder, was = decode_value(entry.value)
        if holder == self.holder:
            since = was or since
            try:
                rev = await kv.update(
                    self.name, encode_value(self.holder, since), last=entry.revision
                )
            except nats.js.errors.KeyWrongLastSequenceError:
                return None
            self.since = since
            return rev
        return None

    async def release(self) -> None:
        """Give the lease up now, so a standby takes over on its next attempt instead of
        waiting out the TTL. Only our own entry is deleted."""
        rev, self._rev, self._deadline, self.since = self._rev, None, None, None
        await self._report()
        if rev is None:
            return
        with contextlib.suppress(nats.errors.Error, nats.js.errors.KeyWrongLastSequenceError):
            kv = await self._bucket()
            await kv.delete(self.name, last=rev)

    def abandon(self) -> None:
        """Stop believing we lead without telling the server: what a crash looks like,
        for tests and for a holder that knows its state is unsafe."""
        self._rev = None
        self._deadline = None
        self.since = None

    async def run(self, stop: asyncio.Event, *, release: bool = True) -> None:
        """Acquire or renew every ttl/3 until `stop`; then release, or with
        `release=False` only stop believing and leave `release()` to the caller.

        The wait before the next attempt is cut short at the deadline, so a lapse is
        reported when it happens, not a period later. A cancelled run is treated as a
        crash: the belief ends at once and the entry is left to expire on the server.
        """
        try:
            while not stop.is_set():
                await self.acquire()
                wait = self.renew_every_s
                if self._deadline is not None:
                    wait = min(wait, max(self._deadline - self._clock(), 0.0) + 0.001)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)
                await self._report()
        except asyncio.CancelledError:
            self.abandon()
            raise
        if release:
            await self.release()
        else:
            # Stopped, not crashed: the belief ends now, but the revision is kept so the
            # owner can still `release()` once its own work has stopped.
            self._deadline = None
            await self._report()

    # ------------------------------------------------------------------ internals

    async def _bucket(self) -> KeyValue:
        if self._kv is not None:
            return self._kv
        kv = await ensure_bucket(self.js, self.bucket, self.ttl_s, self.replicas)
        info = await self.js.stream_info(f"KV_{self.bucket}")
        bucket_ttl = info.config.max_age or 0.0
        # The bucket's TTL is the one the server enforces. A longer one than ours only
        # makes our belief conservative; a shorter one must shorten it, or we could
        # believe we lead after a standby took over.
        if bucket_ttl and bucket_ttl < self.ttl_s:
            log.warning(
                "lease %s: bucket %s expires entries after %gs, not %gs; using %gs",
                self.name,
                self.bucket,
                bucket_ttl,
                self.ttl_s,
                bucket_ttl,
            )
            self.ttl_s = bucket_ttl
        self._kv = kv
        return kv

    async def _report(self) -> None:
        now = self.is_leader
        if now == self._reported:
            return
        self._reported = now
        if now:
            self.terms += 1
        log.info("lease %s: %s %s", self.name, self.holder, "leads" if now else "stands by")
        if self.on_change is not None:
            r = self.on_change(now)
            if inspect.isawaitable(r):
                await r
