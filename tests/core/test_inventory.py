"""Table tests for the inventory: recording allocations, node changes, clones."""

from __future__ import annotations

import pytest

from services.core.errors import AllocationError, CoreError
from services.core.inventory import Allocation, Gpu, Inventory, Node, Shard


def gpus(n: int, model: str = "NVIDIA H100 80GB HBM3", memory_gb: float = 80.0) -> tuple[Gpu, ...]:
    return tuple(Gpu(index=i, uuid=f"GPU-{i}", model=model, memory_gb=memory_gb) for i in range(n))


def node(name: str, n: int = 8, cpu: float = 64, mem: float = 512, **kw: bool) -> Node:
    return Node(name=name, gpus=gpus(n), cpu_cores=cpu, memory_gb=mem, **kw)


def alloc(
    replica: str, *shards: tuple[str, tuple[int, ...]], cpu: float = 0, mem: float = 0
) -> Allocation:
    return Allocation(
        replica=replica,
        shards=tuple(Shard(node=n, gpus=g) for n, g in shards),
        cpu_cores=cpu,
        memory_gb=mem,
    )


def inv_with(*allocs: Allocation) -> Inventory:
    inv = Inventory([node("n1"), node("n2")])
    for a in allocs:
        inv.allocate(a)
    return inv


@pytest.mark.parametrize(
    ("inv", "allocation", "why"),
    [
        pytest.param(inv_with(), alloc("r1", ("n1", (0, 1))), None, id="free GPUs"),
        pytest.param(inv_with(), alloc("r1", ("n9", (0,))), "unknown node n9", id="unknown node"),
        pytest.param(inv_with(), alloc("r1", ("n1", (8,))), "no GPU 8", id="unknown GPU"),
        pytest.param(
            inv_with(alloc("r1", ("n1", (0,)))),
            alloc("r2", ("n1", (0, 1))),
            "GPU 0 on node n1 is held by r1",
            id="GPU already held",
        ),
        pytest.param(
            inv_with(alloc("r1", ("n1", (0,)))),
            alloc("r1", ("n1", (0, 1))),
            None,
            id="a replica may replace its own allocation",
        ),
        pytest.param(inv_with(), alloc("r1", ("n1", (0, 0))), "listed twice", id="GPU twice"),
        pytest.param(
            inv_with(),
            alloc("r1", ("n1", (0,)), ("n1", (1,))),
            "two shards",
            id="shards share a node",
        ),
        pytest.param(inv_with(), alloc("r1"), "no shards", id="no shards"),
        pytest.param(
            inv_with(alloc("r1", ("n1", (0,)), cpu=60)),
            alloc("r2", ("n1", (1,)), cpu=8),
            "4 CPU cores free",
            id="CPU exceeded",
        ),
        pytest.param(
            inv_with(alloc("r1", ("n1", (0,)), mem=500)),
            alloc("r2", ("n1", (1,)), mem=16),
            "12 GB memory free",
            id="memory exceeded",
        ),
        pytest.param(
            inv_with(alloc("r1", ("n1", (0,)), cpu=60)),
            alloc("r1", ("n1", (0,)), cpu=64),
            None,
            id="own CPU counts as free on replace",
        ),
    ],
)
def test_can_allocate(inv: Inventory, allocation: Allocation, why: str | None) -> None:
    before = inv.allocations()
    reason = inv.can_allocate(allocation)
    if why is None:
        assert reason is None
        assert inv.try_allocate(allocation) is None
        assert inv.allocation(allocation.replica) == allocation
    else:
        assert reason is not None
        assert why in reason
        assert inv.try_allocate(allocation) == reason
        assert inv.allocations() == before
        with pytest.raises(AllocationError) as err:
            inv.allocate(allocation)
        assert isinstance(err.value, CoreError)
        assert err.value.replica == allocation.replica


def test_allocate_and_release() -> None:
    inv = inv_with(alloc("r1", ("n1", (0, 1)), ("n2", (3,)), cpu=4, mem=32))
    assert inv.free_gpus("n1") == [2, 3, 4, 5, 6, 7]
    assert inv.holder("n2", 3) == "r1"
    assert inv.free_cpu("n1") == 60
    assert inv.free_memory("n2") == 480
    assert inv.replicas_on("n2") == ("r1",)
    assert inv.release_replica("r1")
    assert not inv.release_replica("r1")
    assert inv.free_gpus("n1") == list(range(8))
    assert inv.holder("n2", 3) is None
    assert inv.free_cpu("n1") == 64


def test_replace_moves_the_replica() -> None:
    inv = inv_with(alloc("r1", ("n1", (0,))))
    inv.allocate(alloc("r1", ("n2", (5,))))
    assert inv.holder("n1", 0) is None
    assert inv.holder("n2", 5) == "r1"


@pytest.mark.parametrize(
    ("change", "schedulable"),
    [
        pytest.param(lambda inv: inv.set_cordoned("n1", True), False, id="cordoned"),
        pytest.param(lambda inv: inv.set_lost("n1", True), False, id="lost"),
        pytest.param(lambda inv: None, True, id="plain node"),
        pytest.param(
            lambda inv: (inv.set_cordoned("n1", True), inv.set_cordoned("n1", False)),
            True,
            id="uncordoned",
        ),
    ],
)
def test_schedulable(change: object, schedulable: bool) -> None:
    inv = inv_with(alloc("r1", ("n1", (0,))))
    change(inv)  # type: ignore[operator]
    assert inv.schedulable("n1") is schedulable
    assert inv.holder("n1", 0) == "r1", "existing allocations stay"


def test_unknown_node_reads_empty() -> None:
    inv = Inventory()
    assert not inv.schedulable("x")
    assert inv.free_gpus("x") == []
    assert inv.free_cpu("x") == 0
    assert inv.node("x") is None
    assert not inv.set_lost("x", True)
    assert inv.remove_node("x") == ()


def test_unhealthy_gpu_is_not_free_but_stays_held() -> None:
    inv = inv_with(alloc("r1", ("n1", (1,))))
    sick = tuple(
        g
        if g.index > 1
        else Gpu(index=g.index, uuid=g.uuid, model=g.model, memory_gb=80, healthy=False)
        for g in gpus(8)
    )
    inv.set_node(Node(name="n1", gpus=sick, cpu_cores=64, memory_gb=512))
    assert inv.free_gpus("n1") == [2, 3, 4, 5, 6, 7]
    assert inv.holder("n1", 1) == "r1"


def test_set_node_keeps_allocations_and_cordon_and_clears_lost() -> None:
    inv = inv_with(alloc("r1", ("n1", (0,)), cpu=8))
    inv.set_cordoned("n1", True)
    inv.set_lost("n1", True)
    inv.set_node(node("n1", cpu=32))
    n1 = inv.node("n1")
    assert n1 is not None
    assert n1.cordoned
    assert not n1.lost
    assert inv.holder("n1", 0) == "r1"
    assert inv.free_cpu("n1") == 24


def test_remove_node_releases_its_replicas() -> None:
    inv = inv_with(alloc("r1", ("n1", (0,)), ("n2", (0,))), alloc("r2", ("n2", (1,))))
    assert inv.remove_node("n1") == ("r1",)
    assert inv.allocation("r1") is None
    assert inv.holder("n2", 0) is None
    assert inv.holder("n2", 1) == "r2"
    assert [n.name for n in inv.nodes()] == ["n2"]


def test_clone_is_independent_both_ways() -> None:
    inv = inv_with(alloc("r1", ("n1", (0,))))
    trial = inv.clone()
    trial.release_replica("r1")
    trial.allocate(alloc("r2", ("n2", (0,))))
    trial.set_cordoned("n2", True)
    assert inv.holder("n1", 0) == "r1"
    assert inv.holder("n2", 0) is None
    assert inv.schedulable("n2")
    inv.allocate(alloc("r3", ("n1", (7,))))
    assert trial.holder("n1", 7) is None


def test_nodes_in_name_order() -> None:
    inv = Inventory([node("b"), node("a"), node("c")])
    assert inv.names() == ("a", "b", "c")
    inv.remove_node("b")
    assert [n.name for n in inv.nodes()] == ["a", "c"]
