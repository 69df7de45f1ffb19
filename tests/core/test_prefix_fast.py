"""The prefix rule's speed-up (services.core.prefix_fast) is the rule: on random workloads
(shared prefixes and not, ASCII or not, tenants and salts, sessions, retries, admission
limits, answers that teach a rate or correct the index, replicas coming and going, an
index small enough to evict and to fill its map of first blocks) `FastPrefix` picks what
`Prefix` picks, says why in the same words, and leaves the same index, block for block."""

from __future__ import annotations

import json
import random
import tracemalloc
from collections.abc import Callable

import pytest

from schemas import events as ev
from services.core import catalog, pickers, prefix, prefix_fast, routing
from services.core.prefix import Prefix
from services.core.prefix_fast import FastPrefix
from tests.core.test_fold import MODEL, Log, at, inventory

pytestmark = pytest.mark.timeout(120)


class _Twins:
    """One log folded event by event, both rules told the same: what left routing after
    each event (as the gateway tells its rule), and every pick, end and answer."""

    def __init__(self, plain: Prefix, fast: FastPrefix) -> None:
        self.log = Log()
        self.rules: tuple[Prefix, FastPrefix] = (plain, fast)
        self.gpu = 0
        self.firsts: set[int] = set()
        """The first blocks of the prompts sent."""
        self.say(MODEL)
        self.say(inventory(gpus=64))

    def say(self, data: ev.Data) -> None:
        assert self.log.add(data, node="n1") is None, self.log.rejections[-1]
        e = ev.make(data, id=f"e{self.log.seq}", time=at(0), source="test")
        for rule in self.rules:
            rule.forget(routing.leaving(self.log.view, e, rule.kept()))

    def ready(self, rid: str) -> None:
        shards = (ev.ShardSpec(node="n1", gpus=(self.gpu,)),)
        self.gpu += 1
        self.say(ev.PlacementDecided(replica=rid, model="m", profile="p", shards=shards, reason=""))
        self.say(
            ev.ReplicaState(
                replica=rid,
                model="m",
                profile="p",
                state="ready",
                shards=shards,
                endpoint="http://n1:1",
            )
        )

    @property
    def m(self) -> catalog.Model:
        m = self.log.view.catalog.resolve("m")
        assert m is not None
        return m

    def same(self, step: str) -> None:
        plain, fast = self.rules
        assert {r: list(lru) for r, lru in plain.index.items()} == {
            r: list(lru) for r, lru in fast.index.items()
        }, step
        assert plain.work == fast.work, step
        assert plain.inflight == fast.inflight, step
        assert plain.corrections == fast.corrections, step
        assert {r: k.value for r, k in plain.rates.items()} == {
            r: k.value for r, k in fast.rates.items()
        }, step
        # The map of first blocks names every replica holding one, but those probed at
        # every pick; and it keeps to its bound.
        assert len(fast._firsts) <= fast.total_blocks // prefix_fast.FIRSTS, step
        for rids in fast._firsts.values():
            assert len(set(rids)) == len(rids), step
        assert fast._untracked <= fast.index.keys(), step
        for rid, lru in fast.index.items():
            if rid in fast._untracked:
                continue
            for first in self.firsts & set(lru):
                assert rid in fast._firsts.get(first, ()), step


def _text(rng: random.Random, n: int) -> str:
    alphabet = "abcdefgh ijk" if rng.random() < 0.8 else "abcé 漢字 xyz"
    return "".join(rng.choice(alphabet) for _ in range(n))


def _workload(seed: int) -> None:
    rng = random.Random(seed)
    total = rng.choice([24, 200, 2_000, 20_000])
    capacity = rng.choice([512, 4_096, 262_144])
    kw = {
        "total_blocks": total,
        "capacity_tokens": capacity,
        "block_chars": rng.choice([64, 256]),
        "threshold": rng.choice([prefix.THRESHOLD, prefix.THRESHOLD, 0.2, 0.8]),
        "stick": rng.choice([prefix.STICK, prefix.STICK, 0.0, 0.5, -1.0]),
    }
    t = _Twins(Prefix(**kw), FastPrefix(**kw))  # type: ignore[arg-type]
    plain, fast = t.rules
    names = 0
    alive: list[str] = []
    # Every other seed a hot one: one long shared prompt, or a longer one over it, sent
    # faster than answered, so that stickiness breaks and a replica holding the shorter
    # one is the coldest.
    hot = seed % 2 == 1
    for _ in range(rng.randrange(4, 10) if hot else rng.randrange(1, 7)):
        t.ready(f"r{names}")
        alive.append(f"r{names}")
        names += 1
    systems = [_text(rng, rng.choice([0, 50, 300, 1_200, 3_000, 6_000])) for _ in range(6)]
    if hot:
        systems = systems[-1:]
    mids = [_text(rng, rng.choice([300, 2_000, 6_000])) for _ in range(3)]
    open_: list[tuple[str, routing.Route]] = []
    for step in range(300):
        op = rng.random()
        label = f"seed {seed} step {step}"
        if op < (0.7 if hot else 0.5) or not open_:
            system = rng.choice(systems)
            if rng.random() < 0.5:
                # A longer prompt over a shared one: a replica holding the shorter holds
                # less of it than the threshold.
                system += rng.choice(mids)
            question = _text(rng, rng.randrange(0, 400))
            if rng.random() < 0.5:
                body: dict[str, object] = {"model": "m", "prompt": system + question}
            else:
                body = {
                    "model": "m",
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": question},
                    ],
                }
            if rng.random() < 0.1:
                body["cache_salt"] = rng.choice(["s1", "s2"])
            session = rng.choice([None, None, None, "u1", "u2"])
            owner = rng.choice([None, None, "a", "b"])
            route = routing.Route("m", session=session, owner=owner, body=json.dumps(body).encode())
            avoid = tuple(rng.sample(alive, k=1)) if alive and rng.random() < 0.1 else ()
            limit = rng.choice([None, None, None, None, None, 1, 2, 4])
            t.firsts.update(plain.cut(t.m, route)[:1])
            got = [rule.pick(t.log.view, t.m, route, avoid=avoid, limit=limit) for rule in t.rules]
            ids = [None if r is None else r.id for r in got]
            assert ids[0] == ids[1], label
            assert plain.explain(route) == fast.explain(route), label
            if ids[0] is not None and rng.random() < (0.1 if hot else 0.4):
                # Answered at once: its first byte, then what its engine served from cache.
                e = plain.explain(route)
                predicted = 0 if e is None else e.predicted_tokens
                cached = rng.choice([0, predicted // 3, predicted])
                ttft = rng.choice([0.01, 0.2])
                for rule in t.rules:
                    rule.observed(ids[0], route, ttft, None)
                    rule.observed(ids[0], route, None, cached, 1_000)
                    rule.done(ids[0], route)
            elif ids[0] is not None:
                open_.append((ids[0], route))
        elif op < (0.75 if hot else 0.7):
            rid, route = open_.pop(rng.randrange(len(open_)))
            for rule in t.rules:
                rule.done(rid, route)
        elif op < 0.8:
            rid, route = rng.choice(open_)
            ttft = rng.choice([0.0, 0.01, 0.05, 0.3])
            for rule in t.rules:
                rule.observed(rid, route, ttft, None)
        elif op < 0.87:
            rid, route = rng.choice(open_)
            e = plain.explain(route)
            predicted = 0 if e is None else e.predicted_tokens
            said = rng.choice([0, predicted // 3, predicted, None])
            for rule in t.rules:
                rule.observed(rid, route, None, said, 1_000)
        elif op < 0.92:
            # A retry: the same request picked again, its first replica avoided.
            i = rng.randrange(len(open_))
            rid, route = open_[i]
            got = [rule.pick(t.log.view, t.m, route, avoid=(rid,)) for rule in t.rules]
            ids = [None if r is None else r.id for r in got]
            assert ids[0] == ids[1], label
            assert plain.explain(route) == fast.explain(route), label
            if ids[0] is not None:
                for rule in t.rules:
                    rule.done(rid)
                open_[i] = (ids[0], route)
        elif op < 0.96 and len(alive) > 1:
            gone = alive.pop(rng.randrange(len(alive)))
            t.say(ev.ReplicaDrain(replica=gone, model="m", reason="scale_down"))
            assert gone not in fast.index and gone not in fast._untracked, label
            assert all(gone not in rids for rids in fast._firsts.values()), label
        elif t.gpu < 14:
            t.ready(f"r{names}")
            alive.append(f"r{names}")
            names += 1
        t.same(label)
    for rid, route in open_:
        for rule in t.rules:
            rule.done(rid, route)
    t.same(f"seed {seed} end")
    assert plain.work == {} and fast.work == {}


@pytest.mark.parametrize("seed", range(60))
def test_the_fast_rule_picks_says_and_records_what_the_plain_rule_does(seed: int) -> None:
    _workload(seed)


@pytest.mark.parametrize("seed", range(40))
def test_the_fast_rule_records_blocks_as_the_plain_rule_does(seed: int) -> None:
    """`record` of prompts that share prefixes, end inside another's, grow it or fork
    from it, with some blocks already held, or thought held and not, or past the bound:
    the same LRU, in the same order, and the same blocks most recent first."""
    rng = random.Random(seed)
    total = rng.choice([40, 200, 2_000])
    plain, fast = Prefix(total_blocks=total), FastPrefix(total_blocks=total)
    bases = ["".join(rng.choice("ab") for _ in range(8 * 80)) for _ in range(4)]
    for step in range(150):
        rid = rng.choice(["r", "s"])
        base = rng.choice(bases)[: 8 * rng.randrange(1, 80)]
        if rng.random() < 0.5:
            base += "".join(rng.choice("ab") for _ in range(8 * rng.randrange(1, 20)))
        hashes = prefix.blocks("m", None, base, 8)
        held = rng.choice([0, plain.depth(rid, hashes), rng.randrange(0, len(hashes) + 2)])
        plain.record(rid, hashes, held=held)
        fast.record(rid, hashes, held=held)
        assert {r: list(x) for r, x in plain.index.items()} == {
            r: list(x) for r, x in fast.index.items()
        }, (seed, step)
        assert plain.recent(rid, 7) == fast.recent(rid, 7), (seed, step)
        assert plain.blocks_held() == fast.blocks_held(), (seed, step)


def test_the_fast_rules_lru_survives_hashes_that_are_not_one_chain() -> None:
    """Blocks recorded in one prompt's order and then in another's (two prompts'
    hashes that collided): the replica holds the last prompt, and nothing fails."""
    fast = FastPrefix(total_blocks=50)
    fast.record("r", [1, 2, 3, 4])
    fast.record("r", [9, 3, 2, 7], held=0)
    fast.record("r", [1, 2, 3, 5], held=3)
    assert fast.depth("r", [1, 2, 3, 5]) == 4
    for i in range(200):
        fast.record("r", [i % 7, (i * 3) % 11 + 100, i], held=i % 3)
    assert fast.blocks_held() <= 50


def test_the_fast_rule_cuts_the_same_blocks_as_the_plain_rule() -> None:
    """ASCII or not, at and around block and chunk boundaries, past `MAX_BLOCKS`."""
    rng = random.Random(5)
    m = catalog.Model(name="m")
    for size in (64, 256):
        plain, fast = Prefix(block_chars=size), FastPrefix(block_chars=size)
        chunk = prefix_fast._CHUNK * size
        for n in (0, 1, size - 1, size, size + 1, chunk - 1, chunk, chunk + size, 8 * chunk + 1):
            for extra in ("", "é", "漢"):
                text = "".join(rng.choice("ab c" + extra) for _ in range(n))
                for owner in (None, "o"):
                    route = routing.Route(
                        "m", owner=owner, body=json.dumps({"prompt": text}).encode()
                    )
                    assert fast.cut(m, route) == plain.cut(m, route), (size, n, extra)
    huge = "x" * (prefix.BLOCK_CHARS * prefix.MAX_BLOCKS + 999)
    route = routing.Route("m", body=json.dumps({"prompt": huge}).encode())
    assert FastPrefix().cut(m, route) == Prefix().cut(m, route)
    assert len(Prefix().cut(m, route)) == prefix.MAX_BLOCKS


def test_a_gateway_with_its_fast_path_makes_the_fast_rule_and_without_it_the_plain() -> None:
    assert type(pickers.make("prefix", fast=True)) is FastPrefix
    assert type(pickers.make("prefix", fast=False)) is Prefix
    assert type(pickers.make("least-inflight", fast=True)) is routing.LeastInflight

    class StandIn(Prefix):
        pass

    # A rule handed in by name keeps its own kind: the speed-up is of `Prefix` itself.
    assert type(pickers.make("prefix", fast=True, rules={"prefix": StandIn})) is StandIn


def _shapes(rng: random.Random) -> dict[str, Callable[[], list[list[int]]]]:
    """Workloads of one replica's prompts, by the shape of the tree they leave."""

    def bits(n: int) -> list[int]:
        return [rng.getrandbits(63) for _ in range(n)]

    def fan(own: int) -> Callable[[], list[list[int]]]:
        def prompts() -> list[list[int]]:
            base = bits(8)
            return [base + bits(own) for _ in range(600 // own)]

        return prompts

    def conversation() -> list[list[int]]:
        out, turn = [], bits(4)
        for _ in range(600):
            turn = turn + bits(1) if len(turn) < 300 else bits(4)
            out.append(turn)
        return out

    return {
        "64-block prompts": lambda: [bits(64) for _ in range(8)],
        "one-block prompts": lambda: [bits(1) for _ in range(600)],
        "two-block prompts": lambda: [bits(2) for _ in range(300)],
        "a prefix and one block of each's own": fan(1),
        "a prefix and two blocks of each's own": fan(2),
        "a conversation one block a turn": conversation,
    }


@pytest.mark.parametrize("shape", list(_shapes(random.Random(0))))
def test_the_fast_rules_index_keeps_to_the_memory_bound_whatever_the_shape(shape: str) -> None:
    """The index's bound in bytes (64 MiB for `TOTAL_BLOCKS`, docs/gateway.md) holds a
    block whatever tree the prompts leave: chains of one block, of two, forks from one
    prefix, a conversation grown a block a turn; the plain rule's measured the same way
    for scale."""
    budget = 64 * 2**20 / prefix.TOTAL_BLOCKS
    got = {}
    for rule in (Prefix, FastPrefix):
        make = _shapes(random.Random(1))[shape]
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        p = rule(total_blocks=40_000)
        for i in range(100):
            for hashes in make():
                p.record(f"r{i}", hashes)
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert p.blocks_held() == 40_000
        got[rule.__name__] = used / p.blocks_held()
    assert got["FastPrefix"] <= budget, (shape, got)
