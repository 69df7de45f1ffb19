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
  loops (`cut`);
- it touches each of the prompt's blocks in the picked replica's LRU (an `OrderedDict`
  of blocks), each touch a cache miss, and a broken pick inserts a whole prompt's blocks
  and evicts as many: here a replica's LRU is an `Lru`, a tree of chains kept in the
  order of their last touch, and a touch costs a look-up a chain on the prompt's path
  (one or two for most prompts), an insertion a new chain, an eviction a chain or a cut
  of one (the same blocks evicted in the same order, `Lru`'s docstring). A match is a
  walk down that path, not a bisection over look-ups in a large table.

Chosen by the gateway's `fast_path` (`--no-fast-path`: `Prefix`, the plain rule, which is
what a reader checks against docs/gateway.md); `pickers.FAST` maps a rule's factory to its
speed-up. Held equal to `Prefix` by tests/core/test_prefix_fast.py (random workloads: the
same pick, the same explanation, the same index, after every step), and every test of
tests/core/test_routing_prefix.py runs on both. The figure it moves: the pick's CPU cost
(tests/bench/bench_prefix.py --only-micro, docs/performance.md).
"""

from __future__ import annotations

import statistics
import struct
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import add, truediv
from typing import cast

from services.core import catalog
from services.core.prefix import (
    CHARS_PER_TOKEN,
    DEFAULT_PREFILL_TPS,
    MAX_BLOCKS,
    Blocks,
    Prefix,
    _Ticket,
)
from services.core.routing import Explained, Route
from services.core.view import ReplicaRecord, View

# _CHUNK is the most blocks one `struct` cuts (`FastPrefix.cut`): a prompt's are encoded
# and cut this many at a time (4 KiB at 256 characters a block; measured against 8, 32
# and 64: the least CPU a pick), and the rest by one more, so that a gateway keeps at
# most this many.
_CHUNK = 16
# FIRSTS: `FastPrefix._firsts` holds at most `total_blocks // FIRSTS` first blocks
# (50,000 by default, about 4 MiB; a prompt's first block is one of its blocks, so only a
# workload of prompts of one or two blocks fills it; past it, the replicas recorded one
# more are probed at every pick, as `Prefix` probes them all).
FIRSTS = 8


class _Node(list[int]):
    """A chain of blocks (itself: a prompt's, from `depth` on) that no prompt recorded at
    the replica forks from but at its end: touched together (a prompt that ends or forks
    inside it splits it there; one that goes on past a chain nothing hangs from extends
    it), so they share their place in the LRU. A list of its blocks, not a list beside
    it (a chain costs one object), keyed in `Lru._order` by what it is, not by its
    blocks (hashed and compared as an object)."""

    __slots__ = ("depth", "kids", "parent")
    __hash__ = object.__hash__  # type: ignore[assignment]
    __eq__ = object.__eq__

    def __init__(self, blocks: Iterable[int], depth: int, parent: _Node | None) -> None:
        super().__init__(blocks)
        self.depth = depth
        """The depth of its first block in every prompt that holds it (a chained hash's
        position is its own)."""
        self.parent = parent
        self.kids = 0
        """The chains that fork from this one's last block."""


class Lru:
    """A replica's LRU as `Prefix` keeps it (an `OrderedDict` of block hashes): the same
    blocks, evicted in the same order, at a cost per chain of a prompt rather than per
    block. The blocks are kept as a tree of chains (`_Node`; each prompt recorded is a
    path from a root), found by their first blocks (`heads`), in the order of their last
    touch (`_order`).

    A chain of one block with nothing hanging from it (a short prompt's, or a prompt's
    own last block past a prefix it shares: most of a workload of short prompts or of
    short questions after one system prompt) has no `_Node` and is not in `heads`: its
    block stands for it in `_order`, mapped to its parent's chain (None at a prompt's
    start), so that it costs about what a block of an `OrderedDict` does.

    Why the order is the same: a prompt's blocks are touched deepest first, so a chain
    is last touched no later than its parent, and with every block of it; the least
    recently touched block is the deepest of the chain touched longest ago, the first
    in `_order` (a dict in insertion order, a touch taking a chain out and putting it
    back at the end), from which no chain hangs.

    How much of a prompt it holds (`held`) is a walk down its path: a look-up a chain
    and one comparison of the chain's last block (a block's hash is its whole prefix's:
    the last equal, all are), a bisection in the chain it leaves. `h in lru` is a walk
    over every block: for tests, not for a pick."""

    __slots__ = ("_order", "heads", "size")

    def __init__(self) -> None:
        self.heads: dict[int, _Node] = {}
        """Each chain with a `_Node` by its first block."""
        self._order: dict[_Node | int, _Node | None] = {}
        """The chains, least recently touched first: a `_Node` (its value None), or the
        block of a chain of one block without one (its value its parent's chain, None at
        a prompt's start)."""
        self.size = 0
        """The blocks held."""

    def held(self, hashes: list[int]) -> int:
        """How many of `hashes`' leading blocks are held (`prefix.held`)."""
        return self._walk(hashes, None)

    def _walk(self, hashes: list[int], path: list[_Node | int] | None) -> int:
        """`held`; with `path`, the chains it runs through appended to it (their keys in
        `_order`), root first, the one it ends or forks inside split there."""
        heads, order, n, d = self.heads, self._order, len(hashes), 0
        while d < n:
            h = hashes[d]
            node = heads.get(h)
            if node is None:
                # A chain of one block without a node, if it hangs where this prompt
                # has it (not another's, whose hash collided).
                if h in order:
                    up = order[h]
                    if up is None if d == 0 else up is not None and up.depth + len(up) == d:
                        d += 1
                        if path is not None:
                            path.append(h)
                break
            if node.depth != d:
                break  # not this prompt's
            blocks = node
            m = min(len(blocks), n - d)
            if blocks[m - 1] == hashes[d + m - 1]:
                k = m
            else:
                # The chain forks from the prompt inside it: bisected (blocks[0] equal).
                lo, hi = 1, m - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if blocks[mid - 1] == hashes[d + mid - 1]:
                        lo = mid
                    else:
                        hi = mid - 1
                k = lo
            d += k
            if k < len(blocks):
                if path is not None:
                    path.append(self._split(node, k))
                break
            if path is not None:
                path.append(node)
        return d

    def record(self, hashes: list[int]) -> None:
        """`Prefix.record`'s touch of a prompt's chain `hashes` (not empty): the chains
        it runs through touched, deepest first, the blocks past them a new chain (or
        the end of the last one, where nothing hangs from it)."""
        path: list[_Node | int] = []
        d = self._walk(hashes, path)
        order, heads = self._order, self.heads
        n = len(hashes)
        if d < n:
            last = path[-1] if path else None
            if isinstance(last, int):
                # A chain of one block goes on: made a node, the new blocks its own.
                node = heads[last] = _Node([last, *hashes[d:]], d - 1, order.pop(last))
                path[-1] = node
            elif last is not None and not last.kids:
                last.extend(hashes[d:])
            elif n - d == 1:
                order[hashes[d]] = last
                if last is not None:
                    last.kids += 1
            else:
                new = _Node(hashes[d:], d, last)
                heads[hashes[d]] = new
                order[new] = None
                if last is not None:
                    last.kids += 1
            self.size += n - d
        for key in reversed(path):
            order[key] = order.pop(key, None)

    def holds(self, h: int) -> bool:
        """Whether `h`, a prompt's first block, is held."""
        return h in self.heads or h in self._order

    def _split(self, node: _Node, at: int) -> _Node:
        """`node`'s first `at` blocks made a chain of their own over it (the new one,
        returned); `node` keeps the rest and its place in `_order`."""
        upper = _Node(node[:at], node.depth, node.parent)
        upper.kids = 1
        del node[:at]
        node.depth += at
        node.parent = upper
        self.heads[upper[0]] = upper
        self.heads[node[0]] = node
        return upper

    def trim(self, cap: int) -> list[int]:
        """Blocks evicted, least recently touched first, until at most `cap` are held;
        the first blocks of prompts that went with them."""
        over = self.size - cap
        gone: list[int] = []
        order, heads = self._order, self.heads
        while over > 0 and order:
            key = next(iter(order))
            if isinstance(key, int):
                parent = order.pop(key)
                if parent is None:
                    gone.append(key)
                else:
                    parent.kids -= 1
                self.size -= 1
                over -= 1
                continue
            blocks = key
            n = len(blocks)
            if n > over:
                # Its deepest ones: it keeps its place.
                del blocks[n - over :]
                self.size -= over
                return gone
            del order[key]
            if heads.get(blocks[0]) is key:
                del heads[blocks[0]]
            self.size -= n
            over -= n
            if key.parent is None:
                gone.append(blocks[0])
            else:
                key.parent.kids -= 1
        return gone

    def firsts(self) -> list[int]:
        """The first blocks of prompts held."""
        return [
            k if isinstance(k, int) else k[0]
            for k, up in self._order.items()
            if (up is None if isinstance(k, int) else k.parent is None)
        ]

    def _ordered(self) -> list[int]:
        """Every block, least recently touched first (a chain's deepest first)."""
        out: list[int] = []
        for k in self._order:
            if isinstance(k, int):
                out.append(k)
            else:
                out.extend(reversed(k))
        return out

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        return iter(self._ordered())

    def __reversed__(self) -> Iterator[int]:
        return reversed(self._ordered())

    def __contains__(self, h: object) -> bool:
        return h in self._ordered()


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
    _cold: dict[int, Explained] = field(default_factory=dict)
    """A cold pick's words, by the number of replicas considered (`Explained` is frozen)."""
    _untracked: set[str] = field(default_factory=set)
    """The replicas recorded a first block while `_firsts` was full: probed at every
    pick, as `Prefix` probes every replica, until their LRU is dropped."""

    def pick(
        self,
        view: View,
        m: catalog.Model,
        route: Route | None = None,
        *,
        avoid: Collection[str] = (),
        limit: int | None = None,
    ) -> ReplicaRecord | None:
        """`Prefix.pick` and the plain rule's `LeastInflight.pick` under it, step for
        step, in one frame for a request without a session (most): its counts, its
        ticket, its blocks recorded. A request of a session (or none at all) is picked
        the plain way."""
        if route is None or route.session is not None:
            return super().pick(view, m, route, avoid=avoid, limit=limit)
        tickets = self._tickets
        old = tickets.get(route)
        text = route.prompt
        # A request picked again (a retry) is not hashed again.
        hashes = self._hashes = old.hashes if old is not None else self.cut(m, route)
        n, most = len(text), self.block_chars * MAX_BLOCKS
        chars = self._chars = most if most < n else n  # min(n, most): a call less
        self._explained = None
        depths: dict[str, int] = {}
        self._depths = depths
        found = self.found(view, m, avoid, limit)
        if not found:
            return None
        r = self.choose(view, m, route, found)  # says why: `_explained`
        rid = r.id
        self._ticks += 1
        self._picked[rid] = self._ticks
        inflight, work = self.inflight, self.work
        inflight[rid] = inflight.get(rid, 0) + 1
        depth = depths.get(rid, 0)
        own = (chars - depth * self.block_chars) / CHARS_PER_TOKEN
        ahead = work.get(rid, 0.0)
        work[rid] = ahead + own
        if old is not None:  # picked again (a retry): the first one's work is done
            del tickets[route]
            self._release(old)
        explained = self._explained
        assert explained is not None
        tickets[route] = _Ticket(rid, ahead, own, hashes, explained)
        if hashes:
            self.record(rid, hashes, held=depth)
        return r

    def done(self, replica: str, route: Route | None = None) -> None:
        """`Prefix.done` and the plain rule's under it, in one frame."""
        inflight = self.inflight
        left = inflight.get(replica, 0) - 1
        if left > 0:
            inflight[replica] = left
        else:
            inflight.pop(replica, None)
        t = None if route is None else self._tickets.get(route)
        if t is not None and t.replica == replica:
            del self._tickets[route]  # type: ignore[arg-type]
            if not t.prefilled:  # else its work left at its first byte (`observed`)
                self._release(t)

    def cut(self, m: catalog.Model, route: Route) -> list[int]:
        """`blocks`' hashes, in C loops for an ASCII prompt (most are): its bytes cut by
        `struct` (an ASCII string hashes as its bytes do: the same SipHash of the same
        bytes), each block's hash that of the one before and the block, the one before
        read back from the list being filled (a list's iterator sees what is appended
        to it while it iterates). The prompt is encoded `_CHUNK` blocks at a time: a
        chunk's bytes land where the last chunk's were, in cache, where the whole
        prompt's would be fresh memory (measured: 18 us of a 32k-character prompt's
        pick, in a gateway's heap, against 2 us alone)."""
        text = route.prompt
        if not text.isascii():
            return super().cut(m, route)
        size = self.block_chars
        chars, most = len(text), size * MAX_BLOCKS
        n = (most if most < chars else chars) // size  # min(chars, most), a call less
        if not n:
            return []
        whole, rest = divmod(n, _CHUNK)
        step = _CHUNK * size
        ends = range(step, whole * step + 1, step)
        chunks = map(text.__getitem__, map(slice, range(0, whole * step, step), ends))
        parts: Iterable[bytes] = chain.from_iterable(
            map(self._struct(_CHUNK).unpack, map(str.encode, chunks))
        )
        if rest:
            tail = text[whole * step : whole * step + rest * size].encode()
            parts = chain(parts, self._struct(rest).unpack(tail))
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

    def _lrus(self) -> dict[str, Lru]:
        """`index`, as what it holds here: `Lru`s."""
        return cast(dict[str, Lru], self.index)

    def depth(self, replica: str, hashes: list[int]) -> int:
        lru = self._lrus().get(replica)
        return 0 if lru is None else lru.held(hashes)

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
            # A prompt shorter than a block (most short chats): the plain rule's pick,
            # said in words kept for each number of replicas considered.
            said = self._cold.get(n)
            if said is None:
                said = self._cold[n] = Explained(0.0, n, "cold", 0)
            self._explained = said
            return found[0] if n == 1 else self._least(found, ids)
        lrus, first, depths = self._lrus(), hashes[0], self._depths
        need = self.threshold * len(hashes)
        # The replicas that hold the first block, looked for in the few LRUs that may.
        holders = self._holders(ids, first)
        warm: list[ReplicaRecord] = []
        for i in holders:
            r = found[i]
            d = depths[r.id] = lrus[r.id].held(hashes)
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
        pos, lrus = self._pos, self._lrus()
        out: list[int] = []
        for rid in got:
            lru = lrus.get(rid)
            if lru is None or not lru.holds(first):
                self._unfirst(first, rid)
            elif (i := pos.get(rid)) is not None:
                out.append(i)
        for rid in untracked:
            if (i := pos.get(rid)) is not None and rid not in got and lrus[rid].holds(first):
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
        """`Prefix.record` on the replica's `Lru` (the same blocks, in the same order;
        what it holds of `hashes` found on the way, `held` not needed), the first block
        noted in `_firsts` (the last touched: no bound evicts it)."""
        if not hashes:
            return
        got = self.index.get(replica)
        if got is None:
            got = self.index[replica] = Lru()
            self._bound()
        lru = cast(Lru, got)
        lru.record(hashes)
        self._trim(replica, lru)
        first, firsts, untracked = hashes[0], self._firsts, self._untracked
        got_ = firsts.get(first)
        if got_ is None:
            if replica in untracked:
                pass
            elif len(firsts) < self.total_blocks // FIRSTS:
                firsts[first] = (replica,)
            else:
                untracked.add(replica)
        elif replica not in got_:
            firsts[first] = (*got_, replica)

    def _trim(self, rid: str, lru: Blocks) -> None:
        cap = min(self._cap, self.capacity.get(rid, self._cap))
        if len(lru) <= cap:
            return
        gone = cast(Lru, lru).trim(cap)
        if self._firsts:
            for h in gone:
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

    def _dropped(self, rid: str, lru: Blocks | None) -> None:
        """`rid`'s LRU `lru` was dropped (cleared by a correction, `Prefix.observed`, or
        the replica forgotten): its first blocks that its LRU now (if any) does not hold
        leave `_firsts`."""
        if lru is None or lru is self.index.get(rid):
            return
        firsts, now = self._firsts, self._lrus().get(rid)
        for h in cast(Lru, lru).firsts():
            if h not in firsts or (now is not None and now.holds(h)):
                continue
            self._unfirst(h, rid)
        if now is None or not now.size:
            self._untracked.discard(rid)

    def forget(self, gone: Iterable[str]) -> None:
        gone = list(gone)
        lrus = [(rid, self.index.get(rid)) for rid in gone]
        super().forget(gone)
        for rid, lru in lrus:
            self._dropped(rid, lru)
