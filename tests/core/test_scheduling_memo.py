"""What the scheduler's pass remembers between placements and passes (an inventory's
version, the placements that found nothing, the digests of failures) is a cost, never a
different answer: each is checked against the plain computation after random changes to
an inventory and its clones."""

from __future__ import annotations

import hashlib
import random
from datetime import UTC, datetime

from services.core import placement, scheduling
from services.core.catalog import Model, Profile
from services.core.inventory import Allocation, Gpu, Inventory, Node, Shard

PROFILES = (
    Profile(name="one", gpus=1, cpu_cores=4.0),
    Profile(name="four", gpus=4, memory_gb=256.0),
    Profile(name="two-by-two", gpus=2, shards=2),
    Profile(name="big", gpus=8, gpu_model="H100"),
)


def _node(name: str, n: int = 8, cpu: float = 64.0, mem: float = 512.0) -> Node:
    gs = tuple(
        Gpu(index=i, uuid=f"{name}-{i}", model="NVIDIA H100", memory_gb=80) for i in range(n)
    )
    return Node(name=name, gpus=gs, cpu_cores=cpu, memory_gb=mem)


def _content(inv: Inventory) -> tuple[object, ...]:
    """Everything placement reads of an inventory, in node order."""
    return tuple(
        (u.node, u.free, u.free_cpu, u.free_memory, u.schedulable)
        for u in sorted(inv.usages(), key=lambda u: u.node.name)
    )


def _change(rng: random.Random, inv: Inventory, n: int) -> int:
    """One random write to `inv` (of every kind an inventory takes); the next replica
    number."""
    node = f"n{rng.randrange(6)}"
    roll = rng.random()
    if roll < 0.45:
        free = inv.free_gpus(node)
        if free:
            n += 1
            take = tuple(free[: rng.randint(1, len(free))])
            alloc = Allocation(replica=f"r{n}", shards=(Shard(node=node, gpus=take),))
            inv.try_allocate(alloc)
    elif roll < 0.75 and n:
        inv.release_replica(f"r{rng.randrange(1, n + 1)}")
    elif roll < 0.85:
        inv.set_cordoned(node, rng.random() < 0.5)
    elif roll < 0.9:
        inv.set_lost(node, rng.random() < 0.5)
    elif roll < 0.95:
        inv.set_node(_node(node, n=rng.choice((4, 8)), cpu=rng.choice((16.0, 64.0))))
    else:
        inv.remove_node(node)
    return n


def test_one_version_is_one_inventory() -> None:
    """Two inventories (a view's and its clones) with the same version hold the same, and
    every write gives a version never seen before."""
    rng = random.Random(11)
    invs = [Inventory([_node(f"n{i}") for i in range(6)])]
    seen: dict[object, tuple[object, ...]] = {}
    n = 0
    for _ in range(2000):
        inv = rng.choice(invs)
        before = inv.version
        n = _change(rng, inv, n)
        if inv.version != before:
            assert inv.version not in seen
        if rng.random() < 0.1:
            invs.append(inv.clone())
            assert invs[-1].version == inv.version
        for other in invs:
            want = seen.setdefault(other.version, _content(other))
            assert _content(other) == want


def test_a_remembered_miss_is_what_placement_finds() -> None:
    """`_place` gives what `placement.place` gives, remembered or not."""
    rng = random.Random(5)
    inv = Inventory([_node(f"n{i}") for i in range(6)])
    n = 0
    misses = 0
    memo = scheduling.Memo()
    for _ in range(3000):
        if rng.random() < 0.3:
            n = _change(rng, inv, n)
        profiles = rng.sample(PROFILES, rng.randint(1, 2))
        avoid = tuple(sorted(rng.sample([f"n{i}" for i in range(6)], rng.randint(0, 2))))
        got = scheduling._place(inv, profiles, avoid, memo)
        assert got == placement.place(inv, profiles, avoid)
        misses += isinstance(got, placement.NoFit)
    assert misses > 100


def test_a_remembered_digest_is_the_hash_of_what_it_was_decided_on() -> None:
    """A failure's digest is the hash of what it was decided on and the cluster's print,
    whether hashed now or found from an earlier pass, as the cluster changes under it."""
    rng = random.Random(3)
    inv = Inventory([_node(f"n{i}") for i in range(6)])
    big = Profile(name="big", gpus=16)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    n = 0
    memo = scheduling.Memo()
    for _ in range(300):
        if rng.random() < 0.3:
            n = _change(rng, inv, n)
        found = placement.place(inv, [big], ())
        assert isinstance(found, placement.NoFit)
        why = dict(found.reasons)
        m = Model(name=rng.choice(("m", "w")), profiles=(big,))
        live = rng.randint(0, 1)
        plain = hashlib.blake2b(
            scheduling._encoder.encode(
                ["no_fit", m.name, ("big",), (), live, 2, sorted(why.items())]
            )
            + scheduling._inventory_print(inv, scheduling.Memo()),
            digest_size=16,
        ).hexdigest()
        out = scheduling.Plan()
        scheduling._fail(
            out,
            scheduling._Maker(now, "test"),
            m,
            "no_fit",
            ("big",),
            why,
            live,
            2,
            (),
            scheduling._NoFit(m, (inv.version, (), live, 2), [big], ("big",), why).digest_with(
                (), inv, memo
            ),
            lambda: ("t", 0),
            now,
            {},
            scheduling.Config(),
        )
        failure = out.outputs[0].failure
        assert failure is not None and failure[1].digest == plain


def test_a_digest_found_among_earlier_prints_is_the_hash_of_what_it_was_decided_on() -> None:
    """Prints come back after others (more of them than are kept, too), equal but not the
    same object, and the same failures are decided on again with them: every digest is
    the hash of the failure and the print it is asked with."""
    rng = random.Random(9)
    prints = [f"[print {i}]".encode() * rng.randint(1, 50) for i in range(20)]
    memo = scheduling.Memo()
    for _ in range(4000):
        printed = bytes(bytearray(rng.choice(prints)))
        model = rng.choice(("a", "b", "c"))
        live, desired = rng.randint(0, 2), rng.randint(1, 3)
        why = {"p": rng.choice(("no node", "short of CPU"))}
        plain = hashlib.blake2b(
            scheduling._encoder.encode(
                ["no_fit", model, ("p",), (), live, desired, sorted(why.items())]
            )
            + printed,
            digest_size=16,
        ).hexdigest()
        got = scheduling._failure_digest(
            "no_fit", model, ("p",), (), live, desired, why, printed, memo
        )
        assert got == plain
    assert len(memo.digests) <= scheduling.DIGESTS_PRINTS
