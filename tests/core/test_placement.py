"""Table tests for placement: profile order, best fit, GPU matching, avoid, reasons."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.catalog import Profile
from services.core.inventory import Allocation, Gpu, Inventory, Node, Shard
from services.core.placement import NoFit, Placement, place

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-40GB"


def node(
    name: str,
    n: int = 8,
    model: str = H100,
    gb: float = 80,
    cpu: float = 64,
    mem: float = 512,
    sick: tuple[int, ...] = (),
    **flags: bool,
) -> Node:
    gs = tuple(
        Gpu(index=i, uuid=f"{name}-{i}", model=model, memory_gb=gb, healthy=i not in sick)
        for i in range(n)
    )
    return Node(name=name, gpus=gs, cpu_cores=cpu, memory_gb=mem, **flags)


def cluster(*nodes: Node, taken: dict[str, tuple[int, ...]] | None = None) -> Inventory:
    inv = Inventory(nodes)
    for i, (name, idx) in enumerate((taken or {}).items()):
        inv.allocate(Allocation(replica=f"old-{i}", shards=(Shard(node=name, gpus=idx),)))
    return inv


def p(name: str = "p", gpus: int = 1, **kw: object) -> Profile:
    return Profile(name=name, gpus=gpus, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("inv", "profiles", "avoid", "expected"),
    [
        pytest.param(
            cluster(node("a"), node("b"), taken={"b": (0, 1, 2, 3, 4)}),
            [p(gpus=2)],
            (),
            ("p", [("b", (5, 6))]),
            id="best fit: fewest free GPUs left",
        ),
        pytest.param(
            cluster(node("b"), node("a")),
            [p(gpus=2)],
            (),
            ("p", [("a", (0, 1))]),
            id="ties by name",
        ),
        pytest.param(
            cluster(node("a"), taken={"a": (0, 2)}),
            [p(gpus=2)],
            (),
            ("p", [("a", (1, 3))]),
            id="lowest free indices",
        ),
        pytest.param(
            cluster(node("a", n=4)),
            [p("tp8", gpus=8), p("tp4", gpus=4)],
            (),
            ("tp4", [("a", (0, 1, 2, 3))]),
            id="profiles tried in order",
        ),
        pytest.param(
            cluster(node("a", n=8), node("b", n=8)),
            [p("tp4", gpus=4), p("tp1", gpus=1)],
            (),
            ("tp4", [("a", (0, 1, 2, 3))]),
            id="first profile that fits wins",
        ),
        pytest.param(
            cluster(node("a"), node("b"), node("c"), taken={"a": (0, 1, 2, 3, 4, 5)}),
            [p(gpus=4, shards=2)],
            (),
            ("p", [("b", (0, 1, 2, 3)), ("c", (0, 1, 2, 3))]),
            id="shards on distinct nodes",
        ),
        pytest.param(
            cluster(node("a", sick=(0, 1, 2)), node("b", n=6)),
            [p(gpus=6)],
            (),
            ("p", [("b", (0, 1, 2, 3, 4, 5))]),
            id="unhealthy GPUs are not free",
        ),
        pytest.param(
            cluster(node("a", cordoned=True), node("b", lost=True), node("c")),
            [p(gpus=1)],
            (),
            ("p", [("c", (0,))]),
            id="cordoned and lost nodes take nothing",
        ),
        pytest.param(
            cluster(node("a", n=2, model=A100, gb=40), node("b", n=8)),
            [p(gpus=1, gpu_memory_gb=80)],
            (),
            ("p", [("b", (0,))]),
            id="GPU memory at least the profile's",
        ),
        pytest.param(
            cluster(node("a", n=2, model=A100, gb=40), node("b", n=8)),
            [p(gpus=1, gpu_model="h100")],
            (),
            ("p", [("b", (0,))]),
            id="gpu_model matches a word, any case",
        ),
        pytest.param(
            cluster(
                node("a", n=2, model="NVIDIA A100-SXM4-80GB"), node("b", n=8, model="NVIDIA A10")
            ),
            [p(gpus=1, gpu_model="A10")],
            (),
            ("p", [("b", (0,))]),
            id="gpu_model A10 does not match A100",
        ),
        pytest.param(
            cluster(node("a", n=2, cpu=4), node("b", n=8)),
            [p(gpus=1, cpu_cores=8)],
            (),
            ("p", [("b", (0,))]),
            id="free CPU covers the shard",
        ),
        pytest.param(
            cluster(node("a", n=2, mem=16), node("b", n=8)),
            [p(gpus=1, memory_gb=32)],
            (),
            ("p", [("b", (0,))]),
            id="free memory covers the shard",
        ),
        pytest.param(
            cluster(node("a", n=2), node("b", n=8)),
            [p(gpus=1)],
            ("a",),
            ("p", [("b", (0,))]),
            id="avoided nodes are skipped when others fit",
        ),
        pytest.param(
            cluster(node("a", n=2), node("b", n=1)),
            [p(gpus=2)],
            ("a",),
            ("p", [("a", (0, 1))]),
            id="avoided nodes are used when nothing else fits",
        ),
        pytest.param(
            cluster(node("a", n=8), node("b", n=1)),
            [p("tp2", gpus=2), p("tp1", gpus=1)],
            ("a",),
            ("tp1", [("b", (0,))]),
            id="avoid outranks profile order",
        ),
        pytest.param(
            cluster(node("a", n=0, cpu=8)),
            [p(gpus=0, cpu_cores=4)],
            (),
            ("p", [("a", ())]),
            id="CPU-only profile",
        ),
    ],
)
def test_place(
    inv: Inventory,
    profiles: list[Profile],
    avoid: tuple[str, ...],
    expected: tuple[str, list[tuple[str, tuple[int, ...]]]],
) -> None:
    before = inv.clone()
    got = place(inv, profiles, avoid)
    assert isinstance(got, Placement), got
    assert (got.profile.name, [(s.node, s.gpus) for s in got.shards]) == expected
    assert [inv.free_gpus(n) for n in inv.names()] == [before.free_gpus(n) for n in inv.names()]


@pytest.mark.parametrize(
    ("inv", "profiles", "why"),
    [
        pytest.param(
            cluster(node("a", n=6), node("b", n=4)),
            [p("tp8", gpus=8, gpu_memory_gb=80)],
            "tp8: no node with 8 free GPUs of >= 80 GB; best had 6",
            id="not enough GPUs, best count",
        ),
        pytest.param(
            cluster(node("a", n=8, gb=40), node("b", n=3)),
            [p("tp4", gpus=4, gpu_memory_gb=80)],
            "tp4: no node with 4 free GPUs of >= 80 GB; best had 3",
            id="best counts only qualifying GPUs",
        ),
        pytest.param(
            cluster(node("a", n=8, model=A100)),
            [p("h", gpus=1, gpu_model="H100")],
            "h: no node with 1 free GPU H100; best had 0",
            id="no GPU of the model",
        ),
        pytest.param(
            cluster(node("a", cpu=2), node("b", cpu=2)),
            [p("c", gpus=1, cpu_cores=8)],
            "c: 2 had the GPUs but not 8 CPU cores",
            id="CPU short",
        ),
        pytest.param(
            cluster(node("a", mem=8)),
            [p("m", gpus=1, memory_gb=64)],
            "m: 1 had the GPUs but not 64 GB memory",
            id="memory short",
        ),
        pytest.param(
            cluster(node("a"), node("b", n=2)),
            [p("pp", gpus=4, shards=2)],
            "pp: only 1 node fits a shard, 2 needed on distinct nodes",
            id="not enough nodes for the shards",
        ),
        pytest.param(
            cluster(node("a", cordoned=True)),
            [p("x", gpus=1)],
            "x: no schedulable node",
            id="nothing schedulable",
        ),
        pytest.param(
            cluster(node("a")),
            [p("tp16", gpus=16), p("tp9", gpus=9)],
            "tp16: no node with 16 free GPUs; best had 8; tp9: no node with 9 free GPUs; best had 8",
            id="one reason per profile",
        ),
        pytest.param(cluster(node("a")), [], "no profiles to place", id="no profiles"),
        pytest.param(
            cluster(node("a")),
            [p("bad", gpus=1, shards=0)],
            "bad: invalid profile: 1 GPU x 0 shards",
            id="invalid profile",
        ),
    ],
)
def test_no_fit(inv: Inventory, profiles: list[Profile], why: str) -> None:
    got = place(inv, profiles)
    assert isinstance(got, NoFit), got
    assert got.summary() == why
    assert [name for name, _ in got.reasons] == [x.name for x in profiles]


def test_deterministic_across_insertion_order() -> None:
    nodes = [node(f"n{i}") for i in range(6)]
    a = Inventory(nodes)
    b = Inventory(reversed(nodes))
    profiles = [p(gpus=3, shards=3)]
    assert place(a, profiles) == place(b, profiles)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_within_the_released_nodes_places_as_every_node_would(seed: int) -> None:
    """`place(..., within=nodes)`: on an inventory where no profile of one shard fitted,
    with replicas released since on those nodes only, looking at those nodes gives the
    placement a look at every node gives (and no placement when it gives none)."""
    rng = random.Random(seed)
    nodes = [
        node(
            f"n{i}",
            n=rng.choice([4, 8]),
            model=rng.choice([H100, A100]),
            gb=rng.choice([40, 80]),
            cpu=rng.choice([16, 64]),
            sick=tuple(rng.sample(range(4), rng.choice([0, 0, 1]))),
            cordoned=rng.random() < 0.1,
        )
        for i in range(rng.randint(1, 8))
    ]
    inv = Inventory(nodes)
    held = []
    for n in nodes:
        free = list(range(len(n.gpus)))
        rng.shuffle(free)
        while free:
            take = [free.pop() for _ in range(min(len(free), rng.choice([1, 1, 2, 4])))]
            rid = f"r{len(held)}"
            inv.allocate(
                Allocation(
                    replica=rid,
                    shards=(Shard(node=n.name, gpus=tuple(sorted(take))),),
                    cpu_cores=rng.choice([0.0, 2.0]),
                    memory_gb=rng.choice([0.0, 64.0]),
                )
            )
            held.append((rid, n.name))
    profiles = [
        p(
            f"p{k}",
            gpus=rng.choice([1, 2, 4, 8]),
            gpu_model=rng.choice([None, "H100"]),
            cpu_cores=rng.choice([0.0, 8.0, 60.0]),
        )
        for k in range(rng.randint(1, 2))
    ]
    avoid = rng.sample([n.name for n in nodes], rng.choice([0, 0, 1]))
    assert isinstance(place(inv, profiles, avoid), NoFit)  # every GPU is held
    released = rng.sample(held, rng.randint(1, min(4, len(held))))
    for rid, _ in released:
        inv.release_replica(rid)
    whole = place(inv, profiles, avoid)
    within = place(inv, profiles, avoid, within=[name for _, name in released])
    if isinstance(whole, Placement):
        assert within == whole
    else:
        assert isinstance(within, NoFit)
