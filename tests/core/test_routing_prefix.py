"""The prefix-aware routing rule (services.core.prefix), pure: a shared prefix goes to
the replica that has it; the index forgets a replica the instant its drain, failure,
node loss or restart is folded; its memory stays in its bound whatever the workload;
an engine's report of 0 cached tokens clears a replica predicted warm; stickiness
breaks before one replica takes a hot prefix's whole load."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import events as ev
from services.core import catalog, prefix, routing
from services.core.prefix import Prefix
from services.core.prefix_fast import FastPrefix
from tests.core.test_fold import MODEL, Log, at, inventory

pytestmark = pytest.mark.timeout(60)

SYSTEM = "You are a careful assistant. " * 40  # ~1,160 characters: 4 blocks


def _route(system: str, question: str, session: str | None = None) -> routing.Route:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    }
    return routing.Route("m", session=session, body=json.dumps(body).encode())


class _Plane:
    """A log folded event by event, the prefix rule told what left routing after each
    event, as the gateway tells it (`Gateway._on_fold`)."""

    rule: type[Prefix] = Prefix
    """The rule's implementation: each test runs on the plain one and its speed-up."""

    def __init__(self, router: Prefix | None = None) -> None:
        self.log = Log()
        self.router = router or self.rule()
        self.gpu = 0
        self.say(MODEL)
        self.say(inventory(gpus=16))

    def say(self, data: ev.Data, node: str = "n1") -> None:
        assert self.log.add(data, node=node) is None, self.log.rejections[-1]
        e = ev.make(data, id=f"e{self.log.seq}", time=at(0), source="test")
        self.router.forget(routing.leaving(self.log.view, e, self.router.kept()))

    def ready(self, rid: str, node: str = "n1") -> tuple[ev.ShardSpec, ...]:
        shards = (ev.ShardSpec(node=node, gpus=(self.gpu,)),)
        self.gpu += 1
        self.say(ev.PlacementDecided(replica=rid, model="m", profile="p", shards=shards, reason=""))
        self.say(self.state(rid, "ready", shards), node=node)
        return shards

    @staticmethod
    def state(
        rid: str, state: ev.ReplicaStateName, shards: tuple[ev.ShardSpec, ...]
    ) -> ev.ReplicaState:
        return ev.ReplicaState(
            replica=rid,
            model="m",
            profile="p",
            state=state,
            shards=shards,
            endpoint="http://n1:1" if state == "ready" else None,
        )

    @property
    def m(self) -> catalog.Model:
        m = self.log.view.catalog.resolve("m")
        assert m is not None
        return m

    def send(self, route: routing.Route, *, end: bool = True) -> str:
        r = self.router.pick(self.log.view, self.m, route)
        assert r is not None
        if end:
            self.router.done(r.id, route)
        return r.id


@pytest.fixture(autouse=True, scope="module", params=[Prefix, FastPrefix], ids=["plain", "fast"])
def _rule(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test on `Prefix` and on its speed-up (services.core.prefix_fast)."""
    _Plane.rule = request.param
    yield
    _Plane.rule = Prefix


def test_a_shared_prefix_goes_to_the_replica_that_has_it_and_groups_spread() -> None:
    p = _Plane()
    for i in range(3):
        p.ready(f"r{i}")
    groups = {g: f"{SYSTEM} group {g}. " * 2 for g in range(3)}
    went: dict[int, set[str]] = {g: set() for g in groups}
    for i in range(12):
        g = i % 3
        went[g].add(p.send(_route(groups[g], f"question {i}")))
    assert all(len(w) == 1 for w in went.values()), went
    assert set().union(*went.values()) == {"r0", "r1", "r2"}
    route = _route(groups[0], "one more")
    p.send(route, end=False)
    e = p.router.explain(route)
    assert e is not None and e.why == "warm" and e.matched >= prefix.THRESHOLD
    assert e.considered == 3 and e.header().startswith("warm; matched=")
    # A prompt shorter than one block has nothing to match: the plain rule.
    short = routing.Route("m", body=b'{"model": "m", "prompt": "hi"}')
    p.send(short, end=False)
    e = p.router.explain(short)
    assert e is not None and e.why == "cold" and e.matched == 0.0


@pytest.mark.parametrize("way", ["drained", "failed", "node_lost", "restarted"])
def test_a_replica_gone_is_never_picked_for_its_old_prefixes(way: str) -> None:
    """Fold-ordered: a replica's prefixes are warm there; the event that takes it out of
    routing for good is folded, and the index holds nothing of it at once; a replica
    that comes back is a new replica, with nothing warm."""
    p = _Plane()
    node = "n2" if way == "node_lost" else "n1"
    if way == "node_lost":
        p.say(inventory("n2", gpus=4), node="n2")
    shards = p.ready("a", node=node)
    p.ready("b")
    route = _route(SYSTEM, "first")
    assert p.send(route) == "a"  # cold: least in flight, the first by name
    assert p.send(_route(SYSTEM, "second")) == "a"  # warm
    assert p.router.depth("a", prefix.blocks("m", None, route.prompt)) > 0
    if way == "drained":
        p.say(ev.ReplicaDrain(replica="a", model="m", reason="scale_down"), node=node)
    elif way == "failed":
        p.say(_Plane.state("a", "failed", shards), node=node)
    elif way == "node_lost":
        p.say(ev.NodeLost(node="n2", reason="no heartbeat"))
    else:  # failed, and started again: a new replica on the same GPUs
        p.say(_Plane.state("a", "failed", shards), node=node)
        p.say(ev.PlacementDecided(replica="a-2", model="m", profile="p", shards=shards, reason=""))
        p.say(_Plane.state("a-2", "ready", shards), node=node)
    # At once: nothing of it is kept, before any request.
    assert "a" not in p.router.index and "a" not in p.router.kept()
    whys = []
    for i in range(6):
        r = _route(SYSTEM, f"after {i}")
        assert p.send(r, end=False) != "a"
        e = p.router.explain(r)
        assert e is not None
        whys.append(e.why)
    assert whys[0] == "cold"  # no replica alive had it: nothing stale said warm


def test_an_engine_report_of_0_cached_tokens_for_a_warm_request_clears_its_entry() -> None:
    p = _Plane()
    p.ready("r0")
    other = _route("A different system prompt altogether. " * 30, "x")
    p.send(other)
    route = _route(SYSTEM, "q1")
    p.send(route)
    again = _route(SYSTEM, "q2")
    rid = p.send(again, end=False)
    e = p.router.explain(again)
    assert e is not None and e.why == "warm" and e.predicted_tokens > 0
    held = prefix.blocks("m", None, other.prompt)
    assert p.router.depth(rid, held) == len(held)
    # The engine says it served none of it from cache: its cache was reset.
    p.router.observed(rid, again, 0.01, 0, 300)
    p.router.done(rid, again)
    assert p.router.depth(rid, held) == 0  # the other prefix is gone from its entry
    mine = prefix.blocks("m", None, again.prompt)
    assert p.router.depth(rid, mine) == len(mine)  # what it just computed is cached now
    assert p.router.corrections == 1
    # A 0 for a request picked while another's prefill was ahead of it says nothing of
    # the cache: the prefix may still have been computing.
    first, second = _route(SYSTEM, "q4"), _route(SYSTEM, "q5")
    p.send(first, end=False)
    p.send(second, end=False)
    p.router.observed(rid, second, None, 0, 300)
    assert p.router.corrections == 1 and p.router.depth(rid, mine) == len(mine)
    for r in (first, second):
        p.router.done(rid, r)
    # A report that agrees changes nothing.
    last = _route(SYSTEM, "q3")
    p.send(last, end=False)
    p.router.observed(rid, last, 0.01, 280, 300)
    assert p.router.corrections == 1


def test_the_prefill_rate_is_learned_from_observed_first_bytes() -> None:
    p = _Plane()
    p.ready("r0")
    for i in range(20):
        r = _route(f"{i} " + "unique prompt text " * (10 + 5 * i), "q")
        rid = p.send(r, end=False)
        t = p.router._tickets[r]
        # ttft = 20 ms + work / 5,000 tokens a second
        assert p.router.work[rid] == t.own  # its prefill in flight
        p.router.observed(rid, r, 0.02 + (t.ahead + t.own) / 5000.0, None)
        assert rid not in p.router.work  # its first byte: its prefill is done
        p.router.observed(rid, r, None, 0, None)
        p.router.done(rid, r)
    tps = p.router.rates["r0"].tps()
    assert tps is not None and 4900 < tps < 5100


def test_stickiness_breaks_before_a_hot_prefix_piles_on_one_replica() -> None:
    """One hot prefix, many requests in flight at once: the warm replica is left when
    it holds more than 1.5 x the mean in flight + 1, so none holds more than that + 1."""
    p = _Plane()
    for i in range(4):
        p.ready(f"r{i}")
    whys = []
    for i in range(40):
        r = _route(SYSTEM, f"hot {i}")
        p.send(r, end=False)
        e = p.router.explain(r)
        assert e is not None
        whys.append(e.why)
    counts = p.router.inflight
    mean = sum(counts.values()) / 4
    assert max(counts.values()) <= 1.5 * mean + 2, counts
    assert "broken" in whys and "warm" in whys


def test_a_session_stays_with_its_replica_under_the_prefix_rule() -> None:
    p = _Plane()
    p.ready("r0")
    p.ready("r1")
    first = p.send(_route("other " * 300, "x", session="s1"))
    for i in range(4):
        p.send(_route(SYSTEM, f"q{i}"))  # SYSTEM warm somewhere
    assert p.send(_route(SYSTEM, "mine", session="s1")) == first


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["send", "send", "send", "done", "forget", "ready"]),
        st.integers(0, 7),
        st.integers(1, 40),
    ),
    min_size=1,
    max_size=120,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, total=st.integers(8, 200), capacity=st.integers(256, 20_000))
def test_the_index_stays_within_its_memory_bound_under_any_workload(
    ops: list[tuple[str, int, int]], total: int, capacity: int
) -> None:
    """Random prompts (shared prefixes of random lengths), replicas coming and going,
    requests ending or not: the blocks held never pass `total_blocks`, nor any replica's
    LRU its capacity; a replica forgotten holds nothing."""
    p = _Plane(_Plane.rule(total_blocks=total, capacity_tokens=capacity))
    names = 0
    alive: list[str] = []
    for _ in range(2):
        alive.append(f"x{names}")
        p.ready(f"x{names}")
        names += 1
    open_: list[tuple[str, routing.Route]] = []
    cap_blocks = max(1, capacity * prefix.CHARS_PER_TOKEN // prefix.BLOCK_CHARS)
    for op, a, b in ops:
        if op == "send" and alive:
            r = _route(f"prefix {a} " * (b * 30), f"q{b}")
            rid = p.router.pick(p.log.view, p.m, r)
            assert rid is not None
            open_.append((rid.id, r))
        elif op == "done" and open_:
            rid_s, r = open_.pop(a % len(open_))
            p.router.done(rid_s, r)
        elif op == "forget" and len(alive) > 1:
            gone = alive.pop(a % len(alive))
            p.say(ev.ReplicaDrain(replica=gone, model="m", reason="scale_down"))
            assert gone not in p.router.index
        elif op == "ready" and p.gpu < 16:
            alive.append(f"x{names}")
            p.ready(f"x{names}")
            names += 1
        held = p.router.blocks_held()
        assert held <= total, (held, total)
        assert all(len(lru) <= cap_blocks for lru in p.router.index.values())
        assert set(p.router.index) <= set(alive)
    for rid_s, r in open_:
        p.router.done(rid_s, r)
    assert p.router.work == {} and p.router._tickets == {}


def test_one_tenants_prefixes_never_make_a_replica_warm_for_another() -> None:
    """The index is keyed by the owner of the request's key: the same prompt from
    another tenant is cold (its answer's `x-llmgw-route` tells nothing of the first's)."""
    p = _Plane()
    p.ready("r0")
    p.ready("r1")

    def owned(owner: str, q: str) -> routing.Route:
        r = _route(SYSTEM, q)
        return routing.Route("m", owner=owner, body=r._body)

    p.send(owned("team-a", "q1"))
    again = owned("team-a", "q2")
    p.send(again, end=False)
    e = p.router.explain(again)
    assert e is not None and e.why == "warm"
    other = owned("team-b", "q3")
    p.send(other, end=False)
    e = p.router.explain(other)
    assert e is not None and e.why == "cold" and e.matched == 0.0


def test_a_huge_prompt_costs_no_more_than_max_blocks() -> None:
    """A body of millions of characters: at most MAX_BLOCKS hashed and kept, so one
    request neither holds the gateway nor flushes more than that of a replica's entry."""
    p = _Plane()
    p.ready("r0")
    huge = routing.Route("m", body=json.dumps({"prompt": "x" * 4_000_000}).encode())
    p.send(huge)
    assert len(p.router.index["r0"]) == prefix.MAX_BLOCKS
    assert len(prefix.blocks("m", None, huge.prompt)) == prefix.MAX_BLOCKS


def test_blocks_recorded_from_elsewhere_make_a_replica_warm_and_read_back_newest_first() -> None:
    """The index's public face, for what shares block hashes between gateways: a
    prompt's blocks (`prefix.blocks`) recorded at a replica make it warm for the prompt,
    and `recent` reads them back, the most recently routed first (a prompt's first
    block, touched last, leads)."""
    p = _Plane()
    p.ready("a")
    p.ready("b")
    route = _route(SYSTEM, "what is a log?")
    hashes = prefix.blocks("m", None, route.prompt)
    p.router.record("b", hashes)
    assert p.router.depth("b", hashes) == len(hashes) and p.router.depth("a", hashes) == 0
    assert p.router.recent("b") == hashes and p.router.recent("b", 2) == hashes[:2]
    assert p.router.recent("a") == []
    assert p.send(route) == "b"
    explained = p.router.explain(route)
    assert explained is None  # ended: nothing kept of it
    again = _route(SYSTEM, "what is a fold?")
    assert p.send(again, end=False) == "b"
    assert p.router.explain(again) == routing.Explained(
        p.router.depth("b", hashes) / len(prefix.blocks("m", None, again.prompt)),
        2,
        "warm",
        p.router.depth("b", hashes) * prefix.BLOCK_CHARS // prefix.CHARS_PER_TOKEN,
    )


def test_a_request_picked_again_is_not_hashed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A retry (the same route picked again, its first replica avoided) reuses the
    prompt's blocks hashed at its first pick."""
    p = _Plane()
    p.ready("a")
    p.ready("b")
    calls = []
    hashed = prefix.blocks
    cut = p.router.cut

    def counted(m: catalog.Model, route: routing.Route) -> list[int]:
        calls.append(1)
        return cut(m, route)

    monkeypatch.setattr(p.router, "cut", counted)
    route = _route(SYSTEM, "retried")
    first = p.router.pick(p.log.view, p.m, route)
    assert first is not None
    again = p.router.pick(p.log.view, p.m, route, avoid=(first.id,))
    assert again is not None and again.id != first.id
    assert len(calls) == 1
    assert p.router.depth(again.id, hashed("m", None, route.prompt)) > 0


@pytest.mark.parametrize("seed", range(20))
def test_recording_with_the_blocks_known_held_leaves_the_same_lru(seed: int) -> None:
    """`record(..., held=n)` (the pick's match, touched without a look first) leaves a
    replica's LRU exactly as `record` that looks at every block, a hole in what was
    thought held included, and bounded the same."""
    import random

    rng = random.Random(seed)
    plain, fast = Prefix(total_blocks=200), Prefix(total_blocks=200)
    pool = [rng.getrandbits(63) for _ in range(300)]
    for _ in range(60):
        hashes = rng.sample(pool, rng.randrange(1, 40))
        held = rng.randrange(0, len(hashes) + 2)
        plain.record("r", hashes)
        fast.record("r", hashes, held=held)
        assert list(plain.index["r"]) == list(fast.index["r"]), seed
