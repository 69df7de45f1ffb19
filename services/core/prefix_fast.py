"""The prefix rule's speed-up (`FastPrefix`): the rule of `services.core.prefix`, the same
picks, the same explanations and the same index (block for block, in the same order), at
less CPU a pick.

Where `Prefix` spends a pick for a long prompt among many replicas, and what this does
instead:
- it looks for the prompt's first block in every replica's LRU, each look-up a cache miss
  in a large index: `FastPrefix` keeps, per first block recorded, the replicas it was
  recorded at (`_firsts`, bounded; past the bound a replica recorded one more is looked
  in at every pick, `_untracked`), and looks in those LRUs alone;
- its other walks over the replicas (the mean in flight, the coldest, the least loaded)
  are Python statements: here C loops (`map` over the replicas' ids, kept while the
  routable list is the same object, which `found` hands on as it is kept when none is
  to be avoided or at its limit; `min` over tuples zipped from the counts), and the
  coldest is not looked for while the warm replica is within the least penalty any cold
  one could set;
- it hashes the prompt's blocks in a Python loop: an ASCII prompt's (most are) here in C
  loops (`cut`).

Chosen by the gateway's `fast_path` (`--no-fast-path`: `Prefix`, the plain rule, which is
what a reader checks against docs/gateway.md); `pickers.FAST` maps a rule's factory to its
speed-up. Held equal to `Prefix` by tests/core/test_prefix_fast.py (random workloads: the
same pick, the same explanation, the same index, after every step), and every test of
tests/core/test_routing_prefix.py runs on both. The figure it moves: the pick's CPU cost
(tests/bench/bench_prefix.py --only-micro, docs/performance.md).
"""

from __future__ import annotations

import collections
import statistics
import struct
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import add, truediv

from services.core import catalog
from services.core.prefix import (
    CHARS_PER_TOKEN,
    DEFAULT_PREFILL_TPS,
    MAX_BLOCKS,
    Prefix,
    held,
)
from services.core.routing import Explained, Route
from services.core.view import ReplicaRecord, View

# _CHUNK is the most blocks one `struct` cuts (`FastPrefix.cut`): a prompt's are cut by
# one of this many, as often as it fits, and one of the rest, so that a gateway keeps at
# most this many.
_CHUNK = 64
# FIRSTS: `FastPrefix._firsts` holds at most `total_blocks // FIRSTS` first blocks
# (50,000 by default, about 4 MiB; a prompt's first block is one of its blocks, so only a
# workload of prompts of one or two blocks fills it; past it, the replicas recorded one
# more are probed at every pick, as `Prefix` probes them all).
FIRSTS = 8
# _NONE stands in for a replica without an LRU: it holds no block.
_NONE: frozenset[int] = frozenset()


@dataclass
class FastPrefix(Prefix):
    """`Prefix` at less CPU a pick (the module docstring)."""

    _ids_of: list[ReplicaRecord] | None = None
    """The list `_ids` are the ids of (the same object: `routable_of`'s, kept per fold)."""
    _ids: list[str] = field(default_factory=list)
    _pos: dict[str, int] = field(default_factory=dict)
    """Each of `_ids`' position."""
    _structs: dict[int, struct.Struct] = field(default_factory=dict)
    """`_struct`'s, by blocks: at most `_CHUNK` of them."""
    _firsts: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Per first block of a prompt recorded (`record`), the replicas it was recorded
    at whose LRU may still hold it: at most `total_blocks // FIRSTS` of them."""
    _untracked: set[str] = field(default_factory=set)
    """The replicas recorded a first block while `_firsts` was full: probed at every
    pick, as `Prefix` probes every replica, until their LRU is dropped."""
    _cold: dict[int, Explained] = field(default_factory=dict)
    """A pick without a prompt's block said (`Explained` is frozen: one per number of
    replicas considered, not one made for each such pick); at most `_CHUNK` of them."""

    def cut(self, m: catalog.Model, route: Route) -> list[int]:
        """`blocks`' hashes, in C loops for an ASCII prompt (most are): its bytes cut by
        `struct` (an ASCII string hashes as its bytes do: the same SipHash of the same
        bytes), each block's hash that of the one before and the block, the one before
        read back from the list being filled (a list's iterator sees what is appended
        to it while it iterates)."""
        text = route.prompt
        if not text.isascii():
            return super().cut(m, route)
        size = self.block_chars
        n = min(len(text), size * MAX_BLOCKS) // size
        if not n:
            return []
        raw = text.encode()
        whole, rest = divmod(n, _CHUNK)
        parts: Iterable[bytes] = ()
        if whole:
            view = memoryview(raw)[: whole * _CHUNK * size]
            parts = chain.from_iterable(self._struct(_CHUNK).iter_unpack(view))
        if rest:
            parts = chain(parts, self._struct(rest).unpack_from(raw, whole * _CHUNK * size))
        out = [hash((m.name, route.salt, route.owner))]
        out.extend(map(hash, zip(iter(out), parts, strict=False)))
        del out[0]
        return out

    def _struct(self, n: int) -> struct.Struct:
        """A `struct` of `n` blocks of `block_chars` bytes (at most `_CHUNK` of them)."""
        got = self._structs.get(n)
        if got is None:
            got = self._structs[n] = struct.Struct(f"{self.block_chars}s" * n)
        return got

    def found(
        self, view: View, m: catalog.Model, avoid: Collection[str], limit: int | None
    ) -> list[ReplicaRecord]:
        """`LeastInflight.found`; the routable list itself (read only) when none is to be
        avoided and none is at `limit` (none of all the replicas counted is)."""
        inflight = self.inflight
        if not avoid and (limit is None or not inflight or max(inflight.values()) < limit):
            return self.routable_of(view, m)
        return super().found(view, m, avoid, limit)

    def _ids_for(self, found: list[ReplicaRecord]) -> list[str]:
        if found is not self._ids_of:
            self._ids_of = found
            self._ids = [r.id for r in found]
            self._pos = dict(zip(self._ids, range(len(found)), strict=True))
        return self._ids

    def _least(self, found: list[ReplicaRecord], ids: list[str]) -> ReplicaRecord:
        """`LeastInflight.choose`: the fewest in flight, ties to the one picked longest
        ago, then the least id (ids are unique: the position is never compared)."""
        inflight, picked = self.inflight, self._picked
        best = min(
            zip(
                map(inflight.get, ids, repeat(0)),
                map(picked.get, ids, repeat(0)),
                ids,
                range(len(ids)),
                strict=True,
            )
        )
        return found[best[3]]

    def choose(
        self, view: View, m: catalog.Model, route: Route | None, found: list[ReplicaRecord]
    ) -> ReplicaRecord:
        """`Prefix.choose`, step for step."""
        ids = self._ids_for(found)
        n = len(found)
        hashes = self._hashes
        if not hashes:
            said = self._cold.get(n)
            if said is None:
                if len(self._cold) >= _CHUNK:
                    self._cold.clear()
                said = self._cold[n] = Explained(0.0, n, "cold", 0)
            self._explained = said
            return self._least(found, ids)
        index, first, depths = self.index, hashes[0], self._depths
        need = self.threshold * len(hashes)
        # The replicas that hold the first block, looked for in the few LRUs that may.
        holders = self._holders(ids, first)
        warm: list[ReplicaRecord] = []
        for i in holders:
            r = found[i]
            d = depths[r.id] = held(index[r.id], hashes)
            if d >= need:
                warm.append(r)
        if not warm:
            return self._said(self._least(found, ids), n, "cold")
        work = self.work
        best = (
            warm[0]
            if len(warm) == 1
            else min(warm, key=lambda r: (work.get(r.id, 0.0), *self._load(r)))
        )
        if len(warm) == n:
            return self._said(best, n, "warm")
        inflight = self.inflight
        mean = (sum(map(inflight.get, ids, repeat(0))) + 1) / n
        hot = inflight.get(best.id, 0) + 1 > self.balance * mean + self.slack
        if not hot and not work.get(best.id):
            return self._said(best, n, "warm")
        warm_ids = {r.id for r in warm}
        rate, same, top = self._rates_of(ids, warm_ids)
        wait_warm = work.get(best.id, 0.0) / rate(best.id)
        if (
            not hot
            and self.stick >= 0
            and wait_warm <= self.stick * depths[best.id] * self.block_chars / CHARS_PER_TOKEN / top
        ):
            # Within the least penalty any cold replica could set (at the fastest rate
            # of all; a penalty is not negative), so within the coldest one's wait and
            # penalty: it stays, and the coldest is not looked for.
            return self._said(best, n, "warm")
        pick_cold = self._coldest_of(found, ids, holders, warm_ids, rate, same)
        cold_rate = rate(pick_cold.id)
        wait_cold = work.get(pick_cold.id, 0.0) / cold_rate
        penalty = self.stick * depths[best.id] * self.block_chars / CHARS_PER_TOKEN / cold_rate
        if wait_warm > wait_cold + penalty or hot:
            return self._said(pick_cold, n, "broken")
        return self._said(best, n, "warm")

    def _holders(self, ids: list[str], first: int) -> list[int]:
        """The positions in `ids` of the replicas whose LRU holds `first`: those
        `_firsts` names for it and the untracked ones, each looked up in its LRU (one
        look-up a replica that may hold it, not one for each of the model's); a name
        whose LRU no longer holds it is dropped from `_firsts`."""
        got = self._firsts.get(first, ())
        untracked = self._untracked
        if not got and not untracked:
            return []
        pos, index = self._pos, self.index
        out: list[int] = []
        for rid in got:
            if first not in index.get(rid, _NONE):
                self._unfirst(first, rid)
            elif (i := pos.get(rid)) is not None:
                out.append(i)
        for rid in untracked:
            if (i := pos.get(rid)) is not None and rid not in got and first in index[rid]:
                out.append(i)
        out.sort()
        return out

    def _rates_of(
        self, ids: list[str], warm_ids: set[str]
    ) -> tuple[Callable[[str], float], bool, float]:
        """`Prefix._rater`'s rates (a replica's own, else the median of the observed
        among `ids`, else `DEFAULT_PREFILL_TPS`) as one look-up; whether no cold
        replica has a rate kept (`Prefix._coldest`'s `same`: no division then); and
        a rate no replica's is above."""
        rates = self.rates
        if not rates:
            return (lambda rid: DEFAULT_PREFILL_TPS), True, DEFAULT_PREFILL_TPS
        kept = rates.keys() & ids
        same = kept <= warm_ids
        tps = {rid: v for rid, k in rates.items() if (v := k.value) is not None}
        got = [v for v in map(tps.get, ids) if v]
        peer = statistics.median(got) if got else DEFAULT_PREFILL_TPS
        get = tps.get
        return (lambda rid: get(rid, peer)), same, max(peer, max(tps.values(), default=peer))

    def _coldest_of(
        self,
        found: list[ReplicaRecord],
        ids: list[str],
        holders: list[int],
        warm_ids: set[str],
        rate: Callable[[str], float],
        same: bool,
    ) -> ReplicaRecord:
        """`Prefix._coldest` over the cold ones of `found`: every replica's key worked
        out in one C loop as if it held none of the prompt; the holders' own keys then
        (a holder's is below the one worked out for it, so the least of all is either a
        replica holding none or a holder); a warm replica the least: the plain walk."""
        work, depths, inflight, picked = self.work, self._depths, self.inflight, self._picked
        chars, size = self._chars, self.block_chars
        own = chars / CHARS_PER_TOKEN
        etas = map(add, map(work.get, ids, repeat(0.0)), repeat(own))
        if not same:
            etas = map(truediv, etas, map(rate, ids))
        keys = zip(
            etas,
            map(inflight.get, ids, repeat(0)),
            map(picked.get, ids, repeat(0)),
            ids,
            range(len(ids)),
            strict=False,
        )
        best = min(keys)
        if best[3] in warm_ids:
            cold = [r for r in found if r.id not in warm_ids]
            return self._coldest(cold, rate)
        for i in holders:
            rid = ids[i]
            if rid in warm_ids:
                continue
            eta = work.get(rid, 0.0) + (chars - depths.get(rid, 0) * size) / CHARS_PER_TOKEN
            if not same:
                eta /= rate(rid)
            key = (eta, inflight.get(rid, 0), picked.get(rid, 0), rid, i)
            if key < best:
                best = key
        return found[best[4]]

    def record(self, replica: str, hashes: list[int], held: int = 0) -> None:
        """`Prefix.record`, the first block noted in `_firsts` (the last touched: no
        bound evicts it)."""
        super().record(replica, hashes, held)
        if not hashes:
            return
        first, firsts, untracked = hashes[0], self._firsts, self._untracked
        got = firsts.get(first)
        if got is None:
            if replica in untracked:
                pass
            elif len(firsts) < self.total_blocks // FIRSTS:
                firsts[first] = (replica,)
            else:
                untracked.add(replica)
        elif replica not in got:
            firsts[first] = (*got, replica)

    def _trim(self, rid: str, lru: OrderedDict[int, None]) -> None:
        cap = min(self._cap, self.capacity.get(rid, self._cap))
        over = len(lru) - cap
        if over <= 0:
            return
        firsts = self._firsts
        if not firsts:
            collections.deque(map(lru.popitem, repeat(False, over)), maxlen=0)
            return
        for h, _ in map(lru.popitem, repeat(False, over)):
            if h in firsts:
                self._unfirst(h, rid)

    def _unfirst(self, first: int, rid: str) -> None:
        """`rid`'s LRU no longer holds `first`."""
        got = self._firsts.get(first, ())
        if rid in got:
            rest = tuple(r for r in got if r != rid)
            if rest:
                self._firsts[first] = rest
            else:
                del self._firsts[first]

    def _dropped(self, rid: str, lru: OrderedDict[int, None] | None) -> None:
        """`rid`'s LRU `lru` was dropped (cleared, or the replica forgotten): its first
        blocks that its LRU now (if any) does not hold leave `_firsts`."""
        if lru is None or lru is self.index.get(rid):
            return
        firsts, now = self._firsts, self.index.get(rid, _NONE)
        for h in [h for h in lru if h in firsts and h not in now]:
            self._unfirst(h, rid)
        if not now:
            self._untracked.discard(rid)

    def observed(
        self,
        replica: str,
        route: Route | None,
        ttft_s: float | None,
        cached_tokens: int | None,
        prompt_tokens: int | None = None,
    ) -> None:
        lru = self.index.get(replica)
        super().observed(replica, route, ttft_s, cached_tokens, prompt_tokens)
        self._dropped(replica, lru)

    def forget(self, gone: Iterable[str]) -> None:
        gone = list(gone)
        lrus = [(rid, self.index.get(rid)) for rid in gone]
        super().forget(gone)
        for rid, lru in lrus:
            self._dropped(rid, lru)
