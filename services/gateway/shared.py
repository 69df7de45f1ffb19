"""The routing rule on the fleet's load and the fleet's cache knowledge.

Used by `services.gateway.share` when gateways share (`--no-share` turns it off): the
gateway's rule (`--routing`) is wrapped in a `FleetPicker`, which decides each pick on
this gateway's own counts, exact, plus what the other gateways last said of theirs
(`Remote`: requests in flight per replica and, for the prefix rule, the uncached
prefill work in flight), so least-in-flight and the prefix rule weigh the whole fleet's
load, not this gateway's slice. The remote counts are added to the rule's own for the
pick alone and taken out after it: between picks the rule's counts are this gateway's
(what it answers a draining agent, what its announcement says).

The prefix rule's cache knowledge is shared as well (`Cache`): each pick's blocks are
told to the others as hashes that mean the same in every process (`stable_blocks`,
CRC-32 and Adler-32: the rule's own hashes are Python's, salted per process), batched, and only the
blocks not told already; what others told is kept per replica, bounded like the rule's
own index (`prefix.TOTAL_BLOCKS` of the others' blocks per gateway, a quarter of that of
those it told, so as not to tell them again), and taught to the rule (its public
`record`, with its public `blocks`) before a pick whose prompt another gateway sent to a
replica deeper than this one knows. So a conversation's next turn through another gateway
finds its warm replica.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.core import catalog, prefix, routing
from services.core.view import ReplicaRecord, View

# _HIGH keeps a stable block hash to 63 bits (a non-negative int64 on the wire).
_HIGH = (1 << 31) - 1


def stable_blocks(
    model: str,
    salt: str | None,
    text: str,
    size: int = prefix.BLOCK_CHARS,
    owner: str | None = None,
) -> list[int]:
    """`prefix.blocks`' blocks (the same cut, as many), hashed the same in every process:
    each the CRC-32 and the Adler-32 of the whole prefix up to its block's end (each
    running on from the block before), seeded with `model`, `salt` and `owner`, as one
    63-bit number. Measured against blake2b chained block by block: 56-64 us against
    117 us for a 32k-character prompt (`prefix.blocks`' own, Python's salted hashes: 25
    us). A false match between two prefixes of one tenant and model only sends a request
    to a replica that turns out cold."""
    out: list[int] = []
    seed = f"{model}\x00{salt or ''}\x00{owner or ''}\x00".encode()
    crc, adler = zlib.crc32(seed), zlib.adler32(seed)
    end = min(len(text), size * prefix.MAX_BLOCKS) - size + 1
    # An ASCII prompt (most are) is encoded once: its bytes are its characters.
    raw = text.encode() if text.isascii() else None
    for i in range(0, end, size):
        block = raw[i : i + size] if raw is not None else text[i : i + size].encode()
        crc, adler = zlib.crc32(block, crc), zlib.adler32(block, adler)
        out.append(((crc & _HIGH) << 32) | adler)
    return out


@dataclass
class Remote:
    """What the other gateways last said of their load, summed over them."""

    inflight: dict[str, int] = field(default_factory=dict)
    work: dict[str, float] = field(default_factory=dict)


@dataclass
class Cache:
    """The block hashes the other gateways routed to each replica (an LRU per replica,
    all of them together at most `total_blocks`), and those this gateway has routed and
    not told yet (`outgoing`) or told already (`told`, bounded alike)."""

    total_blocks: int = prefix.TOTAL_BLOCKS
    told_blocks: int = prefix.TOTAL_BLOCKS // 4
    remote: dict[str, OrderedDict[int, None]] = field(default_factory=dict)
    told: dict[str, OrderedDict[int, None]] = field(default_factory=dict)
    outgoing: dict[str, list[int]] = field(default_factory=dict)
    taught: int = 0
    """Picks whose replica's blocks were taught to the rule from another gateway's."""
    on_routed: Callable[[], None] | None = None
    """Called when blocks wait to be told (the sharing sends them at once, batched with
    whatever else the same turn of the loop routed)."""
    listeners: Mapping[str, Any] | None = None
    """The other gateways there to be told (the sharing's own `peers`, the same dict;
    None: told whoever listens): while it is empty, a lone gateway's picks are neither
    hashed nor kept to be told."""

    def listened(self) -> bool:
        """Whether this gateway's picks are told to anyone."""
        return self.listeners is None or bool(self.listeners)

    def routed(self, rid: str, hashes: list[int]) -> None:
        """This gateway sent a prompt of `hashes` to `rid`: the blocks not told yet go in
        the next batch."""
        told = self.told.get(rid)
        if told is None:
            told = self.told[rid] = OrderedDict()
        new = [h for h in hashes if h not in told]
        for h in hashes:
            told[h] = None
            told.move_to_end(h)
        _trim(self.told, self.told_blocks)
        if new:
            self.outgoing.setdefault(rid, []).extend(new)
            if self.on_routed is not None:
                self.on_routed()

    def batch(self) -> dict[str, tuple[int, ...]]:
        """The blocks to tell now (emptied)."""
        out = {rid: tuple(hs) for rid, hs in self.outgoing.items()}
        self.outgoing.clear()
        return out

    def heard(self, blocks: Mapping[str, Iterable[int]]) -> None:
        """Another gateway routed these blocks to these replicas."""
        for rid, hashes in blocks.items():
            lru = self.remote.get(rid)
            if lru is None:
                lru = self.remote[rid] = OrderedDict()
            for h in hashes:
                lru[h] = None
                lru.move_to_end(h)
        _trim(self.remote, self.total_blocks)

    def depth(self, rid: str, hashes: list[int]) -> int:
        """How many of `hashes`' leading blocks others said they sent to `rid`."""
        lru = self.remote.get(rid)
        return prefix.held(lru, hashes) if lru else 0

    def forget(self, gone: Iterable[str]) -> None:
        for rid in gone:
            self.remote.pop(rid, None)
            self.told.pop(rid, None)
            self.outgoing.pop(rid, None)

    def blocks_held(self) -> int:
        return sum(len(x) for x in self.remote.values()) + sum(len(x) for x in self.told.values())


def _trim(lrus: dict[str, OrderedDict[int, None]], total: int) -> None:
    """Each LRU cut to its share of `total` (oldest first)."""
    if not lrus:
        return
    share = max(1, total // len(lrus))
    for lru in lrus.values():
        while len(lru) > share:
            lru.popitem(last=False)


class FleetPicker:
    """`inner` (the gateway's rule) deciding on the fleet's load and cache knowledge
    (the module docstring). Everything but `pick`, `forget` and `kept` is the rule's own
    (`done`, `observed`, `explain` bound to it, the rest read through)."""

    def __init__(self, inner: routing.Picker, remote: Remote, cache: Cache | None) -> None:
        self.inner = inner
        # The rule's own, as they are: each request calls them (a request is done, a first
        # byte and an end observed, its pick explained), through no frame of this one's.
        self.done: Callable[..., None] = inner.done
        self.observed: Callable[..., None] = inner.observed
        self.explain: Callable[..., routing.Explained | None] = inner.explain
        self.remote = remote
        self.cache = cache if isinstance(getattr(inner, "index", None), dict) else None
        self._counts = inner.inflight if isinstance(inner.inflight, dict) else None
        work = getattr(inner, "work", None)
        self._work: dict[str, float] | None = work if isinstance(work, dict) else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def inflight(self) -> Mapping[str, int]:
        """Requests in flight per replica through this gateway (its own, exact)."""
        return self.inner.inflight

    def pick(
        self,
        view: View,
        m: catalog.Model,
        route: routing.Route | None = None,
        *,
        avoid: Collection[str] = (),
        limit: int | None = None,
    ) -> ReplicaRecord | None:
        stable: list[int] | None = None
        cache = self.cache
        listened = cache is not None and cache.listened()
        if cache is not None and route is not None and (listened or cache.remote):
            stable = self._teach(m, route)
        # A lone gateway (most) has no others' counts to add: `_add` is not called.
        remote = self.remote
        added = bool(remote.inflight or remote.work) and self._add(1)
        try:
            r = self.inner.pick(view, m, route, avoid=avoid, limit=limit)
        finally:
            if added:
                self._add(-1)
        if r is not None and stable and cache is not None and listened:
            cache.routed(r.id, stable)
        return r

    def _add(self, sign: int) -> bool:
        """The others' counts added to the rule's (`sign` 1), or taken out (-1)."""
        remote = self.remote
        counts, work = self._counts, self._work
        did = False
        if counts is not None and remote.inflight:
            did = True
            for rid, n in remote.inflight.items():
                left = counts.get(rid, 0) + sign * n
                if left > 0:
                    counts[rid] = left
                else:
                    counts.pop(rid, None)
        if work is not None and remote.work:
            did = True
            for rid, w in remote.work.items():
                got = work.get(rid, 0.0) + sign * w
                if got > 1e-6:
                    work[rid] = got
                else:
                    work.pop(rid, None)
        return did

    def _teach(self, m: catalog.Model, route: routing.Route) -> list[int]:
        """The prompt's stable blocks; a replica another gateway sent this prefix to
        deeper than the rule knows is taught it (its local blocks, up to that depth)."""
        inner: Any = self.inner
        cache = self.cache
        assert cache is not None
        text = route.prompt
        size = inner.block_chars
        stable = stable_blocks(m.name, route.salt, text, size, route.owner)
        if not stable or not cache.remote:
            return stable
        local: list[int] | None = None
        first = stable[0]
        for rid, lru in cache.remote.items():
            if first not in lru:
                continue
            depth = cache.depth(rid, stable)
            if local is None:
                local = prefix.blocks(m.name, route.salt, text, size, route.owner)
            if inner.depth(rid, local[:depth]) >= depth:
                continue
            # Through the rule's own `record` (touched deepest first, bounded as the
            # rule bounds its index), the one way its index is written.
            inner.record(rid, local[:depth])
            cache.taught += 1
        return stable

    def forget(self, gone: Iterable[str]) -> None:
        gone = list(gone)
        self.inner.forget(gone)
        if self.cache is not None:
            self.cache.forget(gone)

    def kept(self) -> Collection[str]:
        kept = self.inner.kept()
        if self.cache is None:
            return kept
        return set(kept) | self.cache.remote.keys() | self.cache.told.keys()

    def work_of(self) -> Mapping[str, float]:
        """This gateway's own uncached prefill work in flight per replica (empty under a
        rule that keeps none)."""
        return self._work if self._work is not None else {}
