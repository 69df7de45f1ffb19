"""Benchmark of the core's hot paths; prints figures, asserts nothing.

Run from the repository root: `python tests/bench/bench_core.py`.
Cluster: 1,000 nodes x 8 H100s, half the GPUs allocated, 2,000 allocations.
"""

from __future__ import annotations

import statistics
import time

from services.core.catalog import Profile
from services.core.inventory import Allocation, Gpu, Inventory, Node, Shard
from services.core.placement import Placement, place

NODES = 1000
RUNS = 500


def cluster(spread: bool) -> Inventory:
    """Half allocated: either 4 GPUs taken on every node (spread) or every other node full."""
    inv = Inventory(
        Node(
            name=f"gpu-{n:04d}",
            gpus=tuple(
                Gpu(index=i, uuid=f"GPU-{n}-{i}", model="NVIDIA H100 80GB HBM3", memory_gb=80)
                for i in range(8)
            ),
            cpu_cores=128,
            memory_gb=1024,
        )
        for n in range(NODES)
    )
    for n in range(NODES):
        if spread:
            pairs = [(0, 1), (2, 3)]
        elif n % 2 == 0:
            pairs = [(0, 1, 2, 3), (4, 5, 6, 7)]
        else:
            continue
        for k, gpus in enumerate(pairs):
            inv.allocate(
                Allocation(
                    replica=f"r-{n}-{k}",
                    shards=(Shard(node=f"gpu-{n:04d}", gpus=gpus),),
                    cpu_cores=8,
                    memory_gb=64,
                )
            )
    return inv


def median_us(fn: object, runs: int = RUNS) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


TP8 = [Profile(name="tp8", gpus=8, gpu_memory_gb=80, cpu_cores=16, memory_gb=128)]
TP8_H100 = [Profile(name="tp8", gpus=8, gpu_model="H100", gpu_memory_gb=80)]
TP2 = [Profile(name="tp2", gpus=2, cpu_cores=8, memory_gb=64)]


def report(inv: Inventory, label: str) -> None:
    print(f"{len(inv)} nodes, {len(inv.allocations())} allocations, {label}:")
    outcome = "fits" if isinstance(place(inv, TP8), Placement) else "miss"

    def trial() -> None:
        t = inv.clone()
        t.release_replica("r-0-0")

    def trial_place() -> None:
        t = inv.clone()
        t.release_replica("r-0-0")
        t.release_replica("r-0-1")
        place(t, TP8)

    rows = [
        (f"place tp8 ({outcome})", lambda: place(inv, TP8)),
        (f"place tp8 H100 ({outcome})", lambda: place(inv, TP8_H100)),
        ("place tp2 (fits)", lambda: place(inv, TP2)),
        ("clone", inv.clone),
        ("clone + release_replica", trial),
        ("clone + release 2 + place tp8", trial_place),
    ]
    for name, fn in rows:
        print(f"  {name:<32} median {median_us(fn):8.1f} us")


def main() -> None:
    report(cluster(spread=True), "4 of 8 GPUs taken on every node")
    report(cluster(spread=False), "every other node full")


if __name__ == "__main__":
    main()
