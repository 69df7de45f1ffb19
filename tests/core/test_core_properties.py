"""Hypothesis invariants of the core: inventory accounting, clones, placement, quota roll-up."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.core.catalog import Profile
from services.core.inventory import Allocation, Gpu, Inventory, Node, Shard, model_words
from services.core.placement import NoFit, Placement, place
from services.core.quota import ZERO, Amount, Holding, Quota, QuotaTree

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA A10")
T0 = datetime(2026, 1, 1, tzinfo=UTC)


@st.composite
def nodes(draw: st.DrawFn, max_nodes: int = 4) -> list[Node]:
    out = []
    for i in range(draw(st.integers(1, max_nodes))):
        gpus = tuple(
            Gpu(
                index=j,
                uuid=f"n{i}-{j}",
                model=draw(st.sampled_from(MODELS)),
                memory_gb=draw(st.sampled_from([24.0, 40.0, 80.0])),
                healthy=draw(st.integers(0, 4)) != 0,
            )
            for j in range(draw(st.integers(0, 4)))
        )
        out.append(
            Node(
                name=f"n{i}",
                gpus=gpus,
                cpu_cores=draw(st.sampled_from([2.0, 16.0, 64.0])),
                memory_gb=draw(st.sampled_from([16.0, 128.0, 512.0])),
                cordoned=draw(st.integers(0, 5)) == 0,
                lost=draw(st.integers(0, 5)) == 0,
            )
        )
    return out


@st.composite
def allocations(draw: st.DrawFn, names: list[str], count: int = 6) -> list[Allocation]:
    out = []
    for _ in range(draw(st.integers(0, count))):
        chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True))
        shards = tuple(
            Shard(node=n, gpus=tuple(draw(st.lists(st.integers(0, 4), max_size=3, unique=True))))
            for n in chosen
        )
        out.append(
            Allocation(
                replica=f"r{draw(st.integers(0, count))}",
                shards=shards,
                cpu_cores=draw(st.sampled_from([0.0, 1.5, 4.0, 8.0])),
                memory_gb=draw(st.sampled_from([0.0, 8.0, 64.0])),
            )
        )
    return out


def build(ns: list[Node], allocs: list[Allocation]) -> Inventory:
    inv = Inventory(ns)
    for a in allocs:
        inv.try_allocate(a)
    return inv


def check_accounting(inv: Inventory) -> None:
    """No GPU held twice; no node's CPU or memory exceeded; views agree with allocations."""
    owners: dict[tuple[str, int], str] = {}
    cpu: dict[str, float] = {}
    mem: dict[str, float] = {}
    for a in inv.allocations():
        for s in a.shards:
            for i in s.gpus:
                assert (s.node, i) not in owners, f"GPU {s.node}/{i} held twice"
                owners[(s.node, i)] = a.replica
            cpu[s.node] = cpu.get(s.node, 0.0) + a.cpu_cores
            mem[s.node] = mem.get(s.node, 0.0) + a.memory_gb
    for n in inv.nodes():
        assert cpu.get(n.name, 0.0) <= n.cpu_cores + 1e-6
        assert mem.get(n.name, 0.0) <= n.memory_gb + 1e-6
        for g in n.gpus:
            assert inv.holder(n.name, g.index) == owners.get((n.name, g.index))
        expected_free = [
            g.index
            for g in sorted(n.gpus, key=lambda g: g.index)
            if g.healthy and (n.name, g.index) not in owners
        ]
        assert inv.free_gpus(n.name) == expected_free


def snapshot(inv: Inventory) -> object:
    return (
        inv.nodes(),
        inv.allocations(),
        [(n, inv.free_gpus(n), inv.free_cpu(n), inv.free_memory(n)) for n in inv.names()],
    )


@SETTINGS
@given(data=st.data())
def test_allocations_never_double_book(data: st.DataObject) -> None:
    ns = data.draw(nodes())
    inv = build(ns, data.draw(allocations([n.name for n in ns], count=10)))
    check_accounting(inv)
    for _ in range(data.draw(st.integers(0, 6))):
        action = data.draw(st.sampled_from(["release", "allocate", "health", "cordon"]))
        if action == "release":
            inv.release_replica(f"r{data.draw(st.integers(0, 10))}")
        elif action == "allocate":
            for a in data.draw(allocations([n.name for n in ns], count=3)):
                inv.try_allocate(a)
        elif action == "health":
            n = data.draw(st.sampled_from(ns))
            flipped = tuple(
                Gpu(
                    index=g.index,
                    uuid=g.uuid,
                    model=g.model,
                    memory_gb=g.memory_gb,
                    healthy=not g.healthy,
                )
                for g in n.gpus
            )
            inv.set_node(
                Node(name=n.name, gpus=flipped, cpu_cores=n.cpu_cores, memory_gb=n.memory_gb)
            )
        else:
            inv.set_cordoned(data.draw(st.sampled_from(ns)).name, data.draw(st.booleans()))
        check_accounting(inv)


@SETTINGS
@given(data=st.data())
def test_clone_changes_never_touch_the_original(data: st.DataObject) -> None:
    ns = data.draw(nodes())
    names = [n.name for n in ns]
    inv = build(ns, data.draw(allocations(names)))
    before = snapshot(inv)
    trial = inv.clone()
    for a in data.draw(allocations(names)):
        trial.try_allocate(a)
    for r in data.draw(st.lists(st.integers(0, 6), max_size=4)):
        trial.release_replica(f"r{r}")
    trial.set_lost(data.draw(st.sampled_from(names)), True)
    trial.set_cordoned(data.draw(st.sampled_from(names)), True)
    if data.draw(st.booleans()):
        trial.remove_node(data.draw(st.sampled_from(names)))
    assert snapshot(inv) == before
    check_accounting(trial)
    # And the other way: the original changing leaves the clone alone.
    after = snapshot(trial)
    for a in inv.allocations():
        inv.release_replica(a.replica)
    assert snapshot(trial) == after


def shard_fits(
    n: Node,
    held: set[tuple[str, int]],
    used: tuple[float, float],
    prof: Profile,
    gpus: tuple[int, ...],
) -> bool:
    by_index = {g.index: g for g in n.gpus}
    words = model_words(prof.gpu_model) if prof.gpu_model else frozenset()
    return (
        not n.cordoned
        and not n.lost
        and n.cpu_cores - used[0] >= prof.cpu_cores - 1e-9
        and n.memory_gb - used[1] >= prof.memory_gb - 1e-9
        and all(
            i in by_index
            and by_index[i].healthy
            and (n.name, i) not in held
            and by_index[i].memory_gb >= prof.gpu_memory_gb
            and words <= model_words(by_index[i].model)
            for i in gpus
        )
    )


def exhaustive(inv: Inventory, prof: Profile) -> bool:
    """Whether any assignment of shards to distinct nodes and GPU subsets fits."""
    held = {(s.node, i) for a in inv.allocations() for s in a.shards for i in s.gpus}
    used: dict[str, tuple[float, float]] = {}
    for a in inv.allocations():
        for s in a.shards:
            c, m = used.get(s.node, (0.0, 0.0))
            used[s.node] = (c + a.cpu_cores, m + a.memory_gb)
    ns = inv.nodes()
    for combo in itertools.permutations(ns, prof.shards):
        if all(
            any(
                shard_fits(n, held, used.get(n.name, (0.0, 0.0)), prof, gs)
                for gs in itertools.combinations([g.index for g in n.gpus], prof.gpus)
            )
            for n in combo
        ):
            return True
    return False


profiles = st.builds(
    Profile,
    name=st.just("p"),
    gpus=st.integers(0, 4),
    shards=st.sampled_from([1, 1, 1, 2, 3]),
    gpu_memory_gb=st.sampled_from([0.0, 0.0, 40.0, 80.0]),
    gpu_model=st.sampled_from([None, None, None, "H100", "a100", "A10", "nvidia"]),
    cpu_cores=st.sampled_from([0.0, 2.0, 8.0]),
    memory_gb=st.sampled_from([0.0, 16.0, 64.0]),
)


@SETTINGS
@given(data=st.data(), prof=profiles)
def test_place_finds_what_exhaustive_search_finds(data: st.DataObject, prof: Profile) -> None:
    ns = data.draw(nodes())
    inv = build(ns, data.draw(allocations([n.name for n in ns])))
    got = place(inv, [prof])
    assert isinstance(got, Placement) == exhaustive(inv, prof)
    if isinstance(got, NoFit):
        return
    # What place returns is itself a valid placement, and best fit for one shard.
    assert len({s.node for s in got.shards}) == prof.shards
    held = {(s.node, i) for a in inv.allocations() for s in a.shards for i in s.gpus}
    for s in got.shards:
        n = inv.node(s.node)
        assert n is not None
        used = (n.cpu_cores - inv.free_cpu(s.node), n.memory_gb - inv.free_memory(s.node))
        assert len(s.gpus) == prof.gpus
        assert shard_fits(n, held, used, prof, s.gpus)
    trial = inv.clone()
    trial.allocate(
        Allocation(
            replica="new", shards=got.shards, cpu_cores=prof.cpu_cores, memory_gb=prof.memory_gb
        )
    )
    check_accounting(trial)
    if prof.shards == 1:
        fitting = [
            (len(inv.free_gpus(n.name)), n.name)
            for n in ns
            if any(
                shard_fits(
                    n,
                    held,
                    (n.cpu_cores - inv.free_cpu(n.name), n.memory_gb - inv.free_memory(n.name)),
                    prof,
                    gs,
                )
                for gs in itertools.combinations([g.index for g in n.gpus], prof.gpus)
            )
        ]
        assert (len(inv.free_gpus(got.shards[0].node)), got.shards[0].node) == min(fitting)


@st.composite
def trees(draw: st.DrawFn) -> tuple[list[Quota], list[Holding]]:
    owners = [f"o{i}" for i in range(draw(st.integers(1, 6)))]
    quotas = [
        Quota(
            name=o,
            parent=draw(st.none() | st.sampled_from(owners[:i])) if i else None,
            guarantee=Amount(gpus=draw(st.integers(0, 6))),
        )
        for i, o in enumerate(owners)
    ]
    holdings = [
        Holding(
            replica=f"r{j}",
            owner=draw(st.sampled_from([*owners, "stray"])),
            amount=Amount(
                gpus=draw(st.integers(0, 4)), cpu_cores=draw(st.sampled_from([0.0, 0.5, 2.0]))
            ),
            created_at=T0 + timedelta(minutes=draw(st.integers(0, 5))),
        )
        for j in range(draw(st.integers(0, 10)))
    ]
    return quotas, holdings


@SETTINGS
@given(tree=trees())
def test_usage_rolls_up_exactly(tree: tuple[list[Quota], list[Holding]]) -> None:
    quotas, holdings = tree
    parent = {q.name: q.parent for q in quotas}

    def ancestors_or_self(owner: str) -> set[str]:
        out = {owner}
        while parent.get(owner) is not None:
            owner = parent[owner]  # type: ignore[assignment]
            out.add(owner)
        return out

    usage = QuotaTree(quotas).usage(holdings)
    for name in {*parent, *(h.owner for h in holdings)}:
        mine = [h.amount for h in holdings if name in ancestors_or_self(h.owner)]
        expected = ZERO
        for a in mine:
            expected = expected.plus(a)
        assert usage[name].gpus == expected.gpus
        assert abs(usage[name].cpu_cores - expected.cpu_cores) < 1e-9


@SETTINGS
@given(tree=trees())
def test_borrowed_follows_the_guarantees(tree: tuple[list[Quota], list[Holding]]) -> None:
    quotas, holdings = tree
    qt = QuotaTree(quotas)
    borrowed = qt.borrowed(holdings)
    assert borrowed <= {h.replica for h in holdings}
    for h in holdings:
        if not qt.has_guarantee(h.owner):
            assert h.replica in borrowed
    # Covered replicas, summed, fit within every guaranteed level.
    for q in quotas:
        if not q.guarantee.any():
            continue
        covered = ZERO
        for h in holdings:
            if h.replica not in borrowed and q.name in {x.name for x in qt.governing(h.owner)}:
                covered = covered.plus(h.amount)
        assert covered.fits_within(q.guarantee)
