"""The GPU inventory: nodes, their GPUs, and which replica holds what.

Folded by the fold from `node.inventory`, node status events and the replica states that
hold capacity; read by `placement`; cloned by the preemption policy for every trial set of
victims, so `clone()` costs two dictionary copies and writes copy only the node they touch.
No I/O, no clock.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping

import msgspec

from schemas import events as ev
from services.core.errors import AllocationError
from services.core.quota import EPSILON

_WORD = re.compile(r"[a-z0-9]+")


def model_words(name: str) -> frozenset[str]:
    """The words of a GPU model name, lower case, split on anything not a letter or digit."""
    return frozenset(_WORD.findall(name.lower()))


def shortfall(
    gpus: Mapping[int, ev.GpuInfo],
    indices: Iterable[int],
    gpu_model: str | None = None,
    gpu_memory_gb: float = 0.0,
) -> str | None:
    """Why the GPUs `indices` of a node, as its report now has them (`gpus`, by index),
    no longer hold a shard of a profile asking for `gpu_model` and `gpu_memory_gb`
    (placement's own test of a GPU: every word of the model, at least the memory); None
    when they still do. What a report that shrank a node under its replicas does to them."""
    gone = [i for i in indices if i not in gpus]
    if gone:
        return f"GPU {', '.join(map(str, gone))} {'is' if len(gone) == 1 else 'are'} gone"
    words = model_words(gpu_model) if gpu_model else frozenset()
    for i in indices:
        g = gpus[i]
        if words and not words <= model_words(g.model):
            return f"GPU {i} is a {g.model}, not a {gpu_model}"
        if g.memory_gb < gpu_memory_gb:
            return f"GPU {i} has {g.memory_gb:g} GB, not {gpu_memory_gb:g}"
    return None


# Gpu is one GPU as its node reports it: the contract's own GpuInfo, so a node report
# becomes the inventory's node without converting each GPU.
Gpu = ev.GpuInfo


class Node(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A node's inventory as its agent reports it, with the control plane's flags."""

    name: str
    gpus: tuple[Gpu, ...] = ()
    cpu_cores: float = 0.0
    memory_gb: float = 0.0
    labels: Mapping[str, str] = msgspec.field(default_factory=dict)
    cordoned: bool = False
    lost: bool = False


# Shard is one shard of a replica: GPU indices on one node. It is the contract's own
# ShardSpec, so the shards an event carries are recorded as they are, not converted on
# every replica.state the fold applies.
Shard = ev.ShardSpec


class Allocation(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a replica holds: its shards, and CPU cores and memory on each shard's node."""

    replica: str
    shards: tuple[Shard, ...]
    cpu_cores: float = 0.0
    memory_gb: float = 0.0


class NodeUsage:
    """One node and what is held on it; replaced, never changed, so clones can share it.

    `free` is the healthy GPUs no replica holds, lowest index first. `free_cpu` and
    `free_memory` may go below zero when a new inventory report shrinks a node under
    the replicas already on it.
    """

    __slots__ = (
        "exact",
        "free",
        "free_cpu",
        "free_memory",
        "gpus",
        "healthy",
        "held",
        "holders",
        "node",
        "schedulable",
        "words",
    )

    def __init__(
        self,
        node: Node,
        held: dict[str, tuple[tuple[int, ...], float, float]],
        gpus: dict[int, Gpu] | None = None,
        words: dict[int, frozenset[str]] | None = None,
        healthy: tuple[int, ...] | None = None,
    ) -> None:
        self.node = node
        # held: replica -> (GPU indices, CPU cores, memory) that replica holds here.
        self.held = held
        if gpus is None:
            gpus = {g.index: g for g in node.gpus}
            words = {g.index: model_words(g.model) for g in gpus.values()}
            healthy = None
        if healthy is None:
            healthy = tuple(i for i in sorted(gpus) if gpus[i].healthy)
        self.gpus = gpus
        self.words: dict[int, frozenset[str]] = words or {}
        # healthy: the node's healthy GPU indices, sorted; shared by every usage of the
        # same report, since a usage is rebuilt on every allocation and release.
        self.healthy = healthy
        if held:
            holders = self.holders = {i: r for r, (idx, _, _) in held.items() for i in idx}
            self.free = tuple(i for i in healthy if i not in holders)
            # fsum: exactly rounded, so the same replicas give the same free CPU whatever
            # order they were recorded in (a view rebuilt from a snapshot must agree).
            self.free_cpu = node.cpu_cores - math.fsum(c for _, c, _ in held.values())
            self.free_memory = node.memory_gb - math.fsum(m for _, _, m in held.values())
        else:
            self.holders = {}
            self.free = healthy
            self.free_cpu = node.cpu_cores
            self.free_memory = node.memory_gb
        # exact: every amount here is a whole number float arithmetic handles exactly, so
        # adding or taking away another whole amount gives what fsum would.
        self.exact = (
            _whole(node.cpu_cores)
            and _whole(node.memory_gb)
            and all(_whole(c) and _whole(m) for _, c, m in held.values())
        )
        self.schedulable = not node.cordoned and not node.lost

    def with_node(self, node: Node) -> NodeUsage:
        if node.gpus == self.node.gpus:
            return NodeUsage(node, self.held, self.gpus, self.words, self.healthy)
        return NodeUsage(node, self.held)

    def with_held(self, held: dict[str, tuple[tuple[int, ...], float, float]]) -> NodeUsage:
        return NodeUsage(self.node, held, self.gpus, self.words, self.healthy)

    def with_replica(self, replica: str, entry: tuple[tuple[int, ...], float, float]) -> NodeUsage:
        """This usage plus one replica not held here yet.

        The fold records a replica on every placement, so this is its hot path: the
        holders and free GPUs change by the replica's own GPUs, and the free CPU and
        memory by its own amounts, when that is exact (every amount a whole number, as
        node sizes and profiles are in practice). Otherwise the sums are taken again
        with fsum, so free capacity never depends on the order replicas were recorded in.
        """
        held = self.held.copy()
        held[replica] = entry
        idx, cpu, mem = entry
        if not (self.exact and _whole(cpu) and _whole(mem)):
            return NodeUsage(self.node, held, self.gpus, self.words, self.healthy)
        u = NodeUsage.__new__(NodeUsage)
        u.node, u.gpus, u.words, u.healthy = self.node, self.gpus, self.words, self.healthy
        u.schedulable, u.exact = self.schedulable, True
        u.held = held
        holders = u.holders = self.holders.copy()
        for i in idx:
            holders[i] = replica
        u.free = tuple(i for i in self.free if i not in idx)
        u.free_cpu = self.free_cpu - cpu
        u.free_memory = self.free_memory - mem
        return u


# _EXACT bounds the whole numbers float arithmetic adds and subtracts exactly.
_EXACT = float(2**52)


def _whole(x: float) -> bool:
    return x % 1 == 0 and -_EXACT < x < _EXACT


class Version:
    """A name for one state of an inventory's nodes (`Inventory.version`): a new object
    for each, compared by identity, so no counter is kept anywhere."""

    __slots__ = ()


class Inventory:
    """Nodes by name and allocations by replica id.

    Mutable, with a cheap `clone()`: each node's `NodeUsage` is replaced on write, never
    changed in place, so a clone shares every node it has not touched.

    `version` names what the nodes hold: it changes on every write to a node, and no two
    inventories that differ share one, so a result worked out from `usages()` (a
    placement that found nothing) holds for as long as the version stays. That holds
    because `clone()` is the one way to copy an inventory, and a version is an object
    held by whoever keeps a result by it (so never reused): an inventory is never
    pickled or `copy.copy`'d (the view is rebuilt from its state instead).

    Invariant: a GPU is held by at most one replica, and every allocation's shards name
    known nodes and GPU indices that node reported when the allocation was made.
    Unhealthy GPUs, cordoned and lost nodes take no new placement; what replicas already
    hold there stays held until released.
    """

    __slots__ = ("_allocations", "_free", "_nodes", "_order", "version")

    version: Version

    def __init__(self, nodes: Iterable[Node] = ()) -> None:
        self._nodes: dict[str, NodeUsage] = {}
        # _free: the nodes with a healthy GPU nobody holds (`with_free`), kept on every
        # write, so a reader of a full cluster need not look at every node for them.
        self._free: dict[str, None] = {}
        self._allocations: dict[str, Allocation] = {}
        self._order: tuple[str, ...] | None = None
        self.version = Version()
        for n in nodes:
            self.set_node(n)

    def clone(self) -> Inventory:
        """A copy whose changes never touch this one, nor this one's touch it. It has
        this one's version until either changes."""
        out = Inventory.__new__(Inventory)
        out._nodes = self._nodes.copy()
        out._free = self._free.copy()
        out._allocations = self._allocations.copy()
        out._order = self._order
        out.version = self.version
        return out

    def part(self, nodes: Iterable[str], replicas: Iterable[str]) -> Inventory:
        """A copy of only `nodes` and the allocations of `replicas` (those it has): for a
        caller that reads and releases nothing else, such as a trial that releases those
        replicas and places within those nodes. Cheaper than `clone()` by the nodes it
        leaves out; its version is its own."""
        out = Inventory.__new__(Inventory)
        out._nodes = {n: u for n in nodes if (u := self._nodes.get(n)) is not None}
        out._free = {n: None for n, u in out._nodes.items() if u.free}
        out._allocations = {r: a for r in replicas if (a := self._allocations.get(r)) is not None}
        out._order = None
        out.version = Version()
        return out

    # Nodes.

    def set_node(self, node: Node) -> None:
        """Replace a node's inventory, keeping the allocations on it.

        set_node keeps a cordon the node already had: a cordon is an operator's
        decision, and an agent's next inventory report must not undo it. `lost` is
        taken as given, so a fresh report clears it (the agent is back).
        """
        current = self._nodes.get(node.name)
        if current is None:
            self._put(node.name, NodeUsage(node, {}))
            self._order = None
            self.version = Version()
            return
        if current.node.cordoned and not node.cordoned:
            node = msgspec.structs.replace(node, cordoned=True)
        self._put(node.name, current.with_node(node))
        self.version = Version()

    def remove_node(self, name: str) -> tuple[str, ...]:
        """Forget a node and release every replica with a shard on it; returns their ids."""
        usage = self._nodes.get(name)
        if usage is None:
            return ()
        gone = tuple(sorted(usage.held))
        for replica in gone:
            self.release_replica(replica)
        del self._nodes[name]
        self._free.pop(name, None)
        self._order = None
        self.version = Version()
        return gone

    def set_lost(self, name: str, lost: bool) -> bool:
        """Mark a node lost or found; False when the node is unknown."""
        return self._set_flags(name, lost=lost)

    def set_cordoned(self, name: str, cordoned: bool) -> bool:
        """Cordon or uncordon a node; False when the node is unknown."""
        return self._set_flags(name, cordoned=cordoned)

    def _set_flags(self, name: str, **flags: bool) -> bool:
        usage = self._nodes.get(name)
        if usage is None:
            return False
        self._put(name, usage.with_node(msgspec.structs.replace(usage.node, **flags)))
        self.version = Version()
        return True

    def _put(self, name: str, usage: NodeUsage) -> None:
        self._nodes[name] = usage
        if usage.free:
            self._free[name] = None
        else:
            self._free.pop(name, None)

    def with_free(self) -> Iterable[str]:
        """The nodes with a healthy GPU nobody holds (schedulable or not), in no set
        order: on a full cluster, few."""
        return self._free.keys()

    def nodes(self) -> tuple[Node, ...]:
        """Every node, in name order."""
        return tuple(self._nodes[n].node for n in self.names())

    def names(self) -> tuple[str, ...]:
        """Every node name, sorted."""
        if self._order is None:
            self._order = tuple(sorted(self._nodes))
        return self._order

    def node(self, name: str) -> Node | None:
        usage = self._nodes.get(name)
        return None if usage is None else usage.node

    def usage(self, name: str) -> NodeUsage | None:
        """What is held and free on a node, for placement and views."""
        return self._nodes.get(name)

    def usages(self) -> Iterator[NodeUsage]:
        """Every node's usage, in no set order; placement sorts what it needs to."""
        return iter(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def free_gpus(self, node: str) -> list[int]:
        """Healthy GPUs on the node that no replica holds, lowest index first."""
        usage = self._nodes.get(node)
        return [] if usage is None else list(usage.free)

    def free_cpu(self, node: str) -> float:
        usage = self._nodes.get(node)
        return 0.0 if usage is None else usage.free_cpu

    def free_memory(self, node: str) -> float:
        usage = self._nodes.get(node)
        return 0.0 if usage is None else usage.free_memory

    def holder(self, node: str, gpu_index: int) -> str | None:
        usage = self._nodes.get(node)
        return None if usage is None else usage.holders.get(gpu_index)

    def schedulable(self, node: str) -> bool:
        """Whether the node takes new placements: known, not cordoned, not lost."""
        usage = self._nodes.get(node)
        return usage is not None and usage.schedulable

    # Allocations.

    def can_allocate(self, allocation: Allocation) -> str | None:
        """Why this allocation cannot be recorded, or None when it can.

        Replacing a replica's own earlier allocation is allowed: what it held before
        does not count against it. Health, cordons and lost nodes are not checked: they
        stop new placements, not the recording of what a replica already holds.
        """
        if not allocation.shards:
            return "no shards"
        own = self._allocations.get(allocation.replica)
        seen: set[str] = set()
        for shard in allocation.shards:
            if shard.node in seen:
                return f"two shards on node {shard.node}"
            seen.add(shard.node)
            usage = self._nodes.get(shard.node)
            if usage is None:
                return f"unknown node {shard.node}"
            if len(set(shard.gpus)) != len(shard.gpus):
                return f"GPU listed twice on node {shard.node}"
            mine = usage.held.get(allocation.replica) if own is not None else None
            for i in shard.gpus:
                if i not in usage.gpus:
                    return f"node {shard.node} has no GPU {i}"
                holder = usage.holders.get(i)
                if holder is not None and holder != allocation.replica:
                    return f"GPU {i} on node {shard.node} is held by {holder}"
            cpu = usage.free_cpu + (mine[1] if mine else 0.0)
            mem = usage.free_memory + (mine[2] if mine else 0.0)
            if allocation.cpu_cores > cpu + EPSILON:
                return f"node {shard.node} has {cpu:g} CPU cores free, not {allocation.cpu_cores:g}"
            if allocation.memory_gb > mem + EPSILON:
                return f"node {shard.node} has {mem:g} GB memory free, not {allocation.memory_gb:g}"
        return None

    def try_allocate(self, allocation: Allocation) -> str | None:
        """Record the allocation if it can be; returns why not otherwise, changing nothing."""
        reason = self.can_allocate(allocation)
        if reason is None:
            self._record(allocation)
        return reason

    def allocate(self, allocation: Allocation) -> None:
        """Record what a replica holds, replacing what it held before.

        Raises AllocationError (a CoreError) when `can_allocate` gives a reason; callers
        that must not raise on bad input use `try_allocate`.
        """
        reason = self.can_allocate(allocation)
        if reason is not None:
            raise AllocationError(allocation.replica, reason)
        self._record(allocation)

    def restore(self, allocation: Allocation) -> None:
        """Record what a replica held without checking it again, for a view rebuilt from
        a snapshot: the fold accepted it when it happened, and a node report since (a
        GPU gone, a smaller host) does not undo what the replica holds."""
        if all(shard.node in self._nodes for shard in allocation.shards):
            self._record(allocation)

    def _record(self, allocation: Allocation) -> None:
        self.release_replica(allocation.replica)
        entry_cpu, entry_mem = allocation.cpu_cores, allocation.memory_gb
        for shard in allocation.shards:
            usage = self._nodes[shard.node]
            self._put(
                shard.node,
                usage.with_replica(allocation.replica, (shard.gpus, entry_cpu, entry_mem)),
            )
        self.version = Version()
        self._allocations[allocation.replica] = allocation

    def release_replica(self, replica_id: str) -> bool:
        """Free everything a replica holds; False when it held nothing."""
        allocation = self._allocations.pop(replica_id, None)
        if allocation is None:
            return False
        for shard in allocation.shards:
            usage = self._nodes.get(shard.node)
            if usage is None or replica_id not in usage.held:
                continue
            held = dict(usage.held)
            del held[replica_id]
            self._put(shard.node, usage.with_held(held))
            self.version = Version()
        return True

    def release_node(self, replica_id: str, node: str) -> bool:
        """Free what a replica holds on one node, keeping the rest (a shard of a
        multi-node replica stopped while the others run); False when it held nothing
        there."""
        allocation = self._allocations.get(replica_id)
        if allocation is None:
            return False
        rest = tuple(s for s in allocation.shards if s.node != node)
        if len(rest) == len(allocation.shards):
            return False
        if not rest:
            return self.release_replica(replica_id)
        self._record(msgspec.structs.replace(allocation, shards=rest))
        return True

    def allocation(self, replica_id: str) -> Allocation | None:
        return self._allocations.get(replica_id)

    def allocations(self) -> tuple[Allocation, ...]:
        """Every allocation, in replica id order."""
        return tuple(self._allocations[r] for r in sorted(self._allocations))

    def replicas_on(self, node: str) -> tuple[str, ...]:
        """The replicas holding anything on the node, sorted."""
        usage = self._nodes.get(node)
        return () if usage is None else tuple(sorted(usage.held))
