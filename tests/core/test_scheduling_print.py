"""The scheduler's print of the cluster (part of a placement.failed's digest) is the same
whether worked out afresh or reused from an earlier pass: reuse is a cost, never a
different answer."""

from __future__ import annotations

import random

import msgspec

from services.core import scheduling
from services.core.inventory import Allocation, Gpu, Inventory, Node, Shard


def _node(name: str, n: int = 8, cpu: float = 64.5, mem: float = 512.25) -> Node:
    gs = tuple(
        Gpu(index=i, uuid=f"{name}-{i}", model="NVIDIA H100", memory_gb=80) for i in range(n)
    )
    return Node(name=name, gpus=gs, cpu_cores=cpu, memory_gb=mem)


def _fresh(inv: Inventory) -> bytes:
    """The print as it was first written: every row worked out, sorted by node name."""
    return msgspec.json.Encoder(order="sorted").encode(
        [
            (u.node.name, u.free, u.schedulable, round(u.free_cpu, 3), round(u.free_memory, 3))
            for u in sorted(inv.usages(), key=lambda u: u.node.name)
        ]
    )


def test_the_print_reused_is_the_print_worked_out() -> None:
    rng = random.Random(7)
    inv = Inventory([_node(f"n{i:02d}", cpu=64 + i / 3) for i in reversed(range(12))])
    n = 0
    memo = scheduling.Memo()
    for _ in range(300):
        inv2 = inv.clone()
        assert scheduling._inventory_print(inv2, memo) == _fresh(inv2)
        node = f"n{rng.randrange(12):02d}"
        roll = rng.random()
        if roll < 0.5:
            free = inv.free_gpus(node)
            if free:
                n += 1
                inv.allocate(
                    Allocation(
                        replica=f"r{n}",
                        shards=(Shard(node=node, gpus=(free[0],)),),
                        cpu_cores=1.25,
                        memory_gb=3.5,
                    )
                )
        elif roll < 0.8 and n:
            inv.release_replica(f"r{rng.randrange(1, n + 1)}")
        else:
            inv.set_cordoned(node, rng.random() < 0.5)
        assert scheduling._inventory_print(inv, memo) == _fresh(inv)
        assert scheduling._inventory_print(inv, memo) == _fresh(inv)


def test_the_print_reused_across_inventories_and_node_sets_is_the_print_worked_out() -> None:
    """Prints alternate between an inventory and copies of it that differ in a few nodes
    (as a pass and the copies it cordons nodes in do), and nodes come and go: each print
    is the one worked out afresh, whatever was printed just before."""
    rng = random.Random(11)
    inv = Inventory([_node(f"n{i:02d}") for i in range(10)])
    copies: list[Inventory] = [inv]
    n = 0
    memo = scheduling.Memo()
    for _ in range(600):
        base = rng.choice(copies)
        roll = rng.random()
        if roll < 0.1:
            base.set_node(_node(f"n{rng.randrange(14):02d}"))
        elif roll < 0.15 and len(base) > 1:
            base.remove_node(rng.choice(base.names()))
        elif roll < 0.3:
            c = base.clone()
            c.set_cordoned(rng.choice(c.names()), True)
            copies = [*copies[-3:], c]
        else:
            node = rng.choice(base.names())
            free = base.free_gpus(node)
            if free:
                n += 1
                base.allocate(
                    Allocation(
                        replica=f"r{n}",
                        shards=(Shard(node=node, gpus=(free[0],)),),
                        cpu_cores=1.0,
                        memory_gb=2.0,
                    )
                )
        for c in rng.sample(copies, len(copies)):
            assert scheduling._inventory_print(c, memo) == _fresh(c)
