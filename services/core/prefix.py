"""Cache-aware routing: a request goes where its prompt's prefix is already cached,
without hot spots, and what is known of a replica's cache is forgotten the instant the
log says it left (`routing.leaving`).

Pure, like `services.core.routing`: the gateway hands it the folded view, the request's
`Route`, and what each answer said (`observed`); it reads no clock and does no I/O.

The prompt (`Route.prompt`, canonical) is cut into blocks of `BLOCK_CHARS` characters;
each full block's hash chains the one before it, the first the model's name and the
request's `cache_salt` and the owner of its API key (a tenant's routing, and what
`x-llmgw-route` says of it, never tells whether another tenant sent a prompt), so a
block's hash names the whole prefix up to its end. Each
replica has an LRU of the block hashes routed to it (touched deepest first, so that the
shallow blocks a prefix shares are the last evicted, as an engine evicts a chain's tail
first); a replica's match is its deepest block held, found by bisection (the chain makes
what it holds a prefix), its matched fraction that over the prompt's blocks.

The rule, in order (`Prefix.choose`):
- no replica's match reaches `threshold` (half the prompt's blocks; a prompt shorter
  than a block has none): the plain rule, least in flight (`why`: "cold");
- else the warm one (match >= threshold) with the least uncached prefill work in flight
  (the prompt tokens not matched, summed over its requests in flight), ties by least in
  flight ("warm");
- stickiness breaks ("broken") when that replica's estimated wait (its work in flight
  over its prefill rate) exceeds the best cold one's by more than the cold one would
  spend prefilling twice what the warm one has cached (the penalty: `stick` times the
  matched tokens over the cold one's rate), or when it holds more than `balance` times the mean in flight of
  the candidates plus `slack` (one replica never takes a hot prefix's whole load); the
  request then goes to the cold one with the least estimated time to its first token;
- a session goes back to its replica as in the plain rule (`LeastInflight.pick`).

A replica's prefill rate is learned from what the gateway observed (`observed`: the time
to the first byte of each answer against the prefill work the replica had before it, a
least-squares line over a decaying window); until it has observations, the median of
its model's replicas that have some, else `DEFAULT_PREFILL_TPS`.

Bounded: a replica's LRU holds at most its capacity (`capacity_tokens`, the engine's KV
capacity where it is known, else `DEFAULT_CAPACITY_TOKENS`) in blocks, and all of them
together at most `total_blocks`: with more replicas each keeps fewer, its most recent.

Corrected by the engine: an answer that says it had 0 cached tokens where the index
predicted a warm match (and nothing was prefilling ahead of it there, which the engine
may not have shared yet) clears that replica's entry (its cache was reset behind the
index's back) but for the prompt it has just computed; one that says less than half
what was predicted shrinks the replica's LRU to three quarters (an eviction the LRU did
not model).
"""

from __future__ import annotations

import collections
import statistics
from collections import OrderedDict
from collections.abc import Callable, Collection, Container, Iterable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, cast

from services.core import catalog
from services.core.routing import Explained, LeastInflight, Route
from services.core.view import ReplicaRecord, View

# BLOCK_CHARS is the size of a block of the canonical prompt, about 64 tokens. Measured
# (tests/bench/bench_prefix.py --blocks): a pick for a 32k-character prompt costs 2.7x
# more at 64 characters than at 256 (181 against 68 us at p50), and 256 still resolves
# a 2,000-token system prompt to 1.3% of its length; 1,024 costs two thirds as much but
# loses up to 255 tokens of a match and makes a short prompt's one block its whole match.
BLOCK_CHARS = 256
# MAX_BLOCKS bounds the blocks of one prompt hashed and matched (524,288 characters,
# about 131,000 tokens: a long context's whole): a larger body costs no more of the
# gateway's CPU here, nor flushes more of a replica's entry; its match is over them.
MAX_BLOCKS = 2048
# CHARS_PER_TOKEN is how many characters of a prompt the index counts as a token.
CHARS_PER_TOKEN = 4
# THRESHOLD is the share of a prompt's blocks a replica must hold to be warm for it.
# Measured (tests/bench/bench_prefix.py --threshold): llm-d's 0.8 leaves a conversation's
# second and third turns cold (the history before them is 74-79% of their prompt), a hit
# rate of 0.61 against 0.73 at 0.5 on the multi-turn workload (the oracle's 0.75); the
# shared prefixes are the same at both.
THRESHOLD = 0.5
# DEFAULT_CAPACITY_TOKENS is a replica's prefix cache, in tokens, when its engine does
# not say: about what vLLM keeps for an 8B model on one 80 GB GPU.
DEFAULT_CAPACITY_TOKENS = 262_144
# TOTAL_BLOCKS bounds the blocks all replicas' LRUs hold together (about 56 MiB measured
# at 1,000 replicas at capacity, tests/bench/bench_prefix.py).
TOTAL_BLOCKS = 400_000
# DEFAULT_PREFILL_TPS is a replica's prefill rate, prompt tokens a second, before any
# replica of its model has been observed.
DEFAULT_PREFILL_TPS = 10_000.0
# BALANCE and SLACK: a warm replica that would hold more in flight than BALANCE times the
# mean of the candidates plus SLACK is not stuck to (the hot prefix's load spreads).
BALANCE = 1.5
SLACK = 2.0
# STICK scales the penalty a warm replica's wait must pass before a cold one is taken:
# the cold one's time to prefill what the warm one has cached, times STICK. A break costs
# more than the one request's prefill: the cold replica then holds the prefix at another
# prefix's expense, and its line takes the whole prompt. Measured (bench_prefix.py
# --stick, shared prefixes): at 1, 8 breaks in 256 and TTFT p90 101 ms; at 2, 1 break
# and 45 ms (the oracle's 42 ms), hit rate 0.88 and 0.91.
STICK = 2.0
# DECAY weighs each observation of a replica's prefill against those before it.
DECAY = 0.97
# SHRINK is what a replica's LRU is cut to when its engine says it evicted more.
SHRINK = 0.75
# MIN_BLOCKS is the least an LRU is shrunk to.
MIN_BLOCKS = 16


def blocks(
    model: str, salt: str | None, text: str, size: int = BLOCK_CHARS, owner: str | None = None
) -> list[int]:
    """The chained hashes of `text`'s full blocks of `size` characters, the first keyed
    by `model`, `salt` and the `owner` of the key that sent it. In-process hashes: an
    index lives in one gateway's memory."""
    h = hash((model, salt, owner))
    end = min(len(text), size * MAX_BLOCKS) - size + 1
    return [h := hash((h, text[i : i + size])) for i in range(0, end, size)]


class Blocks(Protocol):
    """A replica's LRU as it is read beside its rule's own writes: the blocks it holds,
    least recently routed first (`Prefix`'s is an `OrderedDict`; a speed-up keeps its
    own, the same blocks in the same order)."""

    def __contains__(self, h: object, /) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[int]: ...
    def __reversed__(self) -> Iterator[int]: ...


def held(lru: Container[int], hashes: list[int]) -> int:
    """How many of `hashes`' leading blocks `lru` holds (bisected: a chain held is held
    from its first block). Public: another gateway's blocks are matched the same way."""
    if not hashes or hashes[0] not in lru:
        return 0
    lo, hi = 1, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in lru:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class _Ticket:
    """A request in flight: its replica, the prefill work ahead of it there and its own
    (tokens), its blocks and what the index predicted."""

    replica: str
    ahead: float
    own: float
    hashes: list[int]
    explained: Explained
    prefilled: bool = False
    """Its first byte came: its own work is no longer in flight."""


@dataclass
class _Rate:
    """A replica's observed prefill: decayed sums for the line ttft = base + work / rate."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    value: float | None = None
    """`tps()` as of the last observation."""

    def add(self, x: float, y: float) -> None:
        self.n = self.n * DECAY + 1.0
        self.sx = self.sx * DECAY + x
        self.sy = self.sy * DECAY + y
        self.sxx = self.sxx * DECAY + x * x
        self.sxy = self.sxy * DECAY + x * y
        self.value = self.tps()

    def tps(self) -> float | None:
        """Tokens a second, or None before it can say."""
        if self.n < 2 or self.sy <= 0:
            return None
        var = self.sxx - self.sx * self.sx / self.n
        cov = self.sxy - self.sx * self.sy / self.n
        if var > 1e-9 * max(self.sxx, 1.0) and cov > 0:
            return var / cov
        return self.sx / self.sy if self.sx > 0 else None


@dataclass
class Prefix(LeastInflight):
    """The prefix-aware rule (the module docstring), over the plain rule's counts.

    Public to the gateway and to whatever shares an index between gateways: `record`
    (these blocks were routed to a replica), `recent` (a replica's blocks, most recent
    first), `depth` (how much of a prompt a replica holds), `blocks_held`."""

    reads_prompt: ClassVar[bool] = True
    block_chars: int = BLOCK_CHARS
    threshold: float = THRESHOLD
    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS
    total_blocks: int = TOTAL_BLOCKS
    balance: float = BALANCE
    slack: float = SLACK
    stick: float = STICK
    index: dict[str, Blocks] = field(default_factory=dict)
    """Per replica, the LRU of block hashes routed to it (an `OrderedDict`, most recent
    last; iterated, a speed-up's own LRU gives the same blocks in the same order)."""
    capacity: dict[str, int] = field(default_factory=dict)
    """Per replica, its LRU's own bound in blocks, where it differs from the default."""
    work: dict[str, float] = field(default_factory=dict)
    """Per replica, the uncached prompt tokens of its requests in flight."""
    rates: dict[str, _Rate] = field(default_factory=dict)
    corrections: int = 0
    """Entries cleared or shrunk on an engine's report."""
    _tickets: dict[Route, _Ticket] = field(default_factory=dict)
    _hashes: list[int] = field(default_factory=list)
    _chars: int = 0
    _depths: dict[str, int] = field(default_factory=dict)
    """The pick under way's matches: the replicas considered that hold its first block."""
    _explained: Explained | None = None
    _cap: int = 0

    def pick(
        self,
        view: View,
        m: catalog.Model,
        route: Route | None = None,
        *,
        avoid: Collection[str] = (),
        limit: int | None = None,
    ) -> ReplicaRecord | None:
        """The plain rule's pick (sessions, admission limits) with `choose` below; the
        prompt's blocks recorded at the replica picked."""
        if route is None:
            self._hashes, self._chars = [], 0
        else:
            old = self._tickets.get(route)
            text = route.prompt
            # A request picked again (a retry) is not hashed again.
            self._hashes = old.hashes if old is not None else self.cut(m, route)
            n, most = len(text), self.block_chars * MAX_BLOCKS
            self._chars = most if most < n else n  # min(n, most): a request's call less
        self._explained = None
        self._depths = {}
        r = super().pick(view, m, route, avoid=avoid, limit=limit)
        if r is None or route is None:
            return r
        hashes = self._hashes
        explained = self._explained
        if explained is None:  # its session's replica, not chosen here
            depth = self.depth(r.id, hashes)
            explained = Explained(
                self._matched(depth), 1, "session", depth * self.block_chars // CHARS_PER_TOKEN
            )
        else:
            depth = self._depths.get(r.id, 0)
        own = (self._chars - depth * self.block_chars) / CHARS_PER_TOKEN
        ahead = self.work.get(r.id, 0.0)
        self.work[r.id] = ahead + own
        old = self._tickets.pop(route, None)
        if old is not None:  # picked again (a retry): the first one's work is done
            self._release(old)
        self._tickets[route] = _Ticket(r.id, ahead, own, hashes, explained)
        self.record(r.id, hashes, held=depth)
        return r

    def cut(self, m: catalog.Model, route: Route) -> list[int]:
        """`route`'s prompt's chained block hashes (`blocks`)."""
        return blocks(m.name, route.salt, route.prompt, self.block_chars, route.owner)

    def _matched(self, depth: int) -> float:
        return depth / len(self._hashes) if self._hashes else 0.0

    def choose(
        self, view: View, m: catalog.Model, route: Route | None, found: list[ReplicaRecord]
    ) -> ReplicaRecord:
        """Among `found`: warm, else cold, stickiness broken when waiting there costs
        more than the cache saves (the module docstring)."""
        hashes = self._hashes
        if not hashes:
            self._explained = Explained(0.0, len(found), "cold", 0)
            return super().choose(view, m, route, found)
        # Each replica's match: one look-up for a replica without the first block, as
        # most are, and a bisection for the few with it.
        index, first, depths = self.index, hashes[0], self._depths
        need = self.threshold * len(hashes)
        warm: list[ReplicaRecord] = []
        for r in found:
            lru = index.get(r.id)
            if lru is not None and first in lru:
                d = depths[r.id] = held(lru, hashes)
                if d >= need:
                    warm.append(r)
        if not warm:
            return self._said(super().choose(view, m, route, found), len(found), "cold")
        work = self.work
        best = (
            warm[0]
            if len(warm) == 1
            else min(warm, key=lambda r: (work.get(r.id, 0.0), *self._load(r)))
        )
        if len(warm) == len(found):
            # All warm: no cold one can be sooner.
            return self._said(best, len(found), "warm")
        inflight = self.inflight
        mean = (sum(inflight.get(r.id, 0) for r in found) + 1) / len(found)
        hot = inflight.get(best.id, 0) + 1 > self.balance * mean + self.slack
        if not hot and not work.get(best.id):
            # Nothing to wait for at the best: no cold one can be sooner.
            return self._said(best, len(found), "warm")
        warm_ids = {r.id for r in warm}
        cold = [r for r in found if r.id not in warm_ids]
        rate = self._rater(found)
        pick_cold = self._coldest(cold, rate)
        cold_rate = rate(pick_cold.id)
        wait_warm = work.get(best.id, 0.0) / rate(best.id)
        wait_cold = work.get(pick_cold.id, 0.0) / cold_rate
        penalty = self.stick * depths[best.id] * self.block_chars / CHARS_PER_TOKEN / cold_rate
        if wait_warm > wait_cold + penalty or hot:
            return self._said(pick_cold, len(found), "broken")
        return self._said(best, len(found), "warm")

    def _said(self, r: ReplicaRecord, considered: int, why: str) -> ReplicaRecord:
        d = self._depths.get(r.id, 0)
        tokens = d * self.block_chars // CHARS_PER_TOKEN
        self._explained = Explained(self._matched(d), considered, why, tokens)
        return r

    def _coldest(self, cold: list[ReplicaRecord], rate: Callable[[str], float]) -> ReplicaRecord:
        """The cold replica with the least estimated seconds to the request's first
        token: the work ahead of it and its own uncached tokens, at the replica's rate;
        ties to the plain rule's."""
        work, depths, inflight, picked = self.work, self._depths, self.inflight, self._picked
        chars, size = self._chars, self.block_chars
        # Without a rate observed for any of them, the rates are all the same: the
        # division changes no order and is skipped.
        same = not any(r.id in self.rates for r in cold)
        best: tuple[float, int, int, str] | None = None
        best_eta = 0.0
        chosen = cold[0]
        for r in cold:
            rid = r.id
            eta = work.get(rid, 0.0) + (chars - depths.get(rid, 0) * size) / CHARS_PER_TOKEN
            if not same:
                eta /= rate(rid)
            # The tie-break's key is built only for a tie or better (most are worse).
            if best is not None and eta > best_eta:
                continue
            key = (eta, inflight.get(rid, 0), picked.get(rid, 0), rid)
            if best is None or key < best:
                best, best_eta, chosen = key, eta, r
        return chosen

    def _rater(self, found: list[ReplicaRecord]) -> Callable[[str], float]:
        """Each replica's prefill rate; the median of its peers' (`found`) before it has
        its own, worked out only if asked."""
        rates = self.rates
        peers: list[float] = []

        def rate(rid: str) -> float:
            k = rates.get(rid)
            if k is not None and k.value is not None:
                return k.value
            if not peers:
                got = [k.value for r in found if (k := rates.get(r.id)) and k.value]
                peers.append(statistics.median(got) if got else DEFAULT_PREFILL_TPS)
            return peers[0]

        return rate

    def depth(self, replica: str, hashes: list[int]) -> int:
        """How many of `hashes`' leading blocks `replica`'s LRU holds."""
        lru = self.index.get(replica)
        return 0 if lru is None else held(lru, hashes)

    def record(self, replica: str, hashes: list[int], held: int = 0) -> None:
        """`hashes` (a prompt's chained blocks, `blocks`) were routed to `replica`: they
        are now cached there, touched deepest first, its LRU bounded. `held`: how many
        of the leading ones its LRU is known to hold (`depth`), touched without a look
        first (a pick's match is most of a warm prompt)."""
        if not hashes:
            return
        got = self.index.get(replica)
        if got is None:
            got = self.index[replica] = OrderedDict()
            self._bound()
        lru = cast("OrderedDict[int, None]", got)
        held = min(held, len(hashes)) if held > 0 else 0
        touch = lru.move_to_end
        for h in reversed(hashes[held:]):
            if h in lru:
                touch(h)
            else:
                lru[h] = None
        if held:
            shallow = hashes[held - 1 :: -1]
            try:
                collections.deque(map(touch, shallow), maxlen=0)
            except KeyError:
                # One was not held after all: all touched again, in the same order (a
                # block's place is its last touch's), the missing ones added.
                for h in shallow:
                    if h in lru:
                        touch(h)
                    else:
                        lru[h] = None
        self._trim(replica, lru)

    def recent(self, replica: str, n: int | None = None) -> list[int]:
        """`replica`'s block hashes, the most recently routed first (at most `n`)."""
        lru = self.index.get(replica)
        if lru is None:
            return []
        it = reversed(lru)
        return list(it) if n is None else [h for _, h in zip(range(n), it, strict=False)]

    def _bound(self) -> None:
        """A replica more: every LRU cut to the share of `total_blocks` each may hold."""
        self._cap = self._share()
        for rid, lru in self.index.items():
            self._trim(rid, lru)

    def _share(self) -> int:
        share = max(1, self.total_blocks // max(1, len(self.index)))
        return min(share, max(1, self.capacity_tokens * CHARS_PER_TOKEN // self.block_chars))

    def _trim(self, rid: str, lru: Blocks) -> None:
        cap = min(self._cap, self.capacity.get(rid, self._cap))
        od = cast("OrderedDict[int, None]", lru)
        while len(od) > cap:
            od.popitem(last=False)

    def observed(
        self,
        replica: str,
        route: Route | None,
        ttft_s: float | None,
        cached_tokens: int | None,
        prompt_tokens: int | None = None,
    ) -> None:
        """What an answer of `replica` to `route` said: at its first byte, the time to it
        (its prefill is done: its work leaves the replica's, and the replica's prefill
        rate is learned); at its end, the prompt tokens its engine served from cache
        (corrects the index: the module docstring)."""
        t = None if route is None else self._tickets.get(route)
        if t is None or t.replica != replica or replica not in self._picked:
            return  # not picked here, or gone since: nothing of it is kept again
        if ttft_s is not None and not t.prefilled:
            # Its prefill is done: its work is no longer ahead of anyone's.
            self._release(t)
            t.prefilled = True
            if ttft_s > 0:
                rate = self.rates.get(replica)
                if rate is None:  # not one made for each answer, to be dropped
                    rate = self.rates[replica] = _Rate()
                rate.add(t.ahead + t.own, ttft_s)
        predicted = t.explained.predicted_tokens
        if cached_tokens is None or predicted <= 0 or t.ahead > 0:
            # With prefills ahead of it at its pick, the prefix it matched may have been
            # still computing there (an engine shares only blocks computed): no word on
            # what the cache held.
            return
        if cached_tokens == 0 and t.explained.matched >= self.threshold:
            self.corrections += 1
            dropped = self.index.pop(replica, None)
            self.record(replica, t.hashes)
            self._dropped(replica, dropped)
        elif cached_tokens * 2 < predicted:
            self.corrections += 1
            lru = self.index.get(replica)
            if lru is not None:
                self.capacity[replica] = max(MIN_BLOCKS, int(len(lru) * SHRINK))
                self._trim(replica, lru)

    def explain(self, route: Route | None) -> Explained | None:
        """Why `route`'s request, in flight, went where it went."""
        t = None if route is None else self._tickets.get(route)
        return None if t is None else t.explained

    def done(self, replica: str, route: Route | None = None) -> None:
        super().done(replica, route)
        t = None if route is None else self._tickets.get(route)
        if t is not None and t.replica == replica:
            del self._tickets[route]  # type: ignore[arg-type]
            if not t.prefilled:  # else its work left at its first byte (`observed`)
                self._release(t)

    def _release(self, t: _Ticket) -> None:
        if t.prefilled:
            return
        left = self.work.get(t.replica, 0.0) - t.own
        if left > 1e-6:
            self.work[t.replica] = left
        else:
            self.work.pop(t.replica, None)

    def _dropped(self, rid: str, lru: Blocks | None) -> None:
        """`rid`'s LRU `lru` was dropped by a correction (`observed`), a new one made in
        its place: nothing to do here; a speed-up's own structures follow it."""

    def forget(self, gone: Iterable[str]) -> None:
        """Drop the replicas' index entries, rates and bounds the instant they leave
        routing for good; their requests in flight stay counted until each is `done`."""
        gone = list(gone)
        super().forget(gone)
        for rid in gone:
            self.index.pop(rid, None)
            self.rates.pop(rid, None)
            self.capacity.pop(rid, None)
        if self.index:
            self._cap = self._share()

    def kept(self) -> Collection[str]:
        return self._picked.keys() | self.index.keys() | self.rates.keys()

    def blocks_held(self) -> int:
        """The blocks all LRUs hold (the bound is `total_blocks`)."""
        return sum(len(lru) for lru in self.index.values())
