"""The walks of the fast engine's index that outlive one decision: node-aware's lazy
search's order of the nodes per number of victims (`Walks`), and the gangs per node the
lazy gang search reads (`GangNodes`), each kept by what moved since it was last read.
No I/O, no clock.
"""

from __future__ import annotations

import heapq
import statistics
from bisect import insort
from collections.abc import Iterator
from datetime import datetime
from typing import Protocol

from services.core.policy.decision import Exclusion
from services.core.policy.fast.entries import EPOCH, Group, ModelEntry, Rep, drop
from services.core.view import ReplicaRecord, View


class Kept(Protocol):
    """What the index (`index.Kept`) keeps that its walks and its `Found` read: the
    live replicas per node and their GPUs summed largest first, the groups, the models'
    entries, the excluded by state and of unknown models, the walks themselves."""

    _nodes: dict[str, dict[str, Rep]]
    _tops: dict[str, tuple[int, ...]]
    _groups: dict[tuple[str, str, bool, bool, bool], Group]
    _models: dict[str, ModelEntry]
    _by_state: list[tuple[str, Exclusion]]
    _unknown: list[tuple[str, ReplicaRecord]]
    _walks: Walks
    _gang_nodes: GangNodes | None


WalkEntry = tuple[float, bool, datetime, str]


class Walks:
    """Per number of victims k (as calls ask for them), the nodes with k replicas or
    more in the order node-aware's lazy search walks them (`node_levels`), by the GPUs
    their k largest hold: by the least work k of them throw away (their loading seconds
    times GPUs, the k smallest summed), then by the k-th oldest last use among them (the
    least idle of the k longest unused; a node with fewer than k ever used last). Kept
    by the nodes whose replicas moved (`moved`): those of every model with a replica the
    view journaled since (`View.journal`: a loading time, read by every node of its
    model), and the node of each replica only used since (`View.uses`); worked out again
    when a call reads."""

    __slots__ = ("at", "by", "models", "moved", "seen")

    def __init__(self) -> None:
        self.by: dict[int, dict[int, list[WalkEntry]]] = {}
        self.at: dict[int, dict[str, tuple[int, WalkEntry]]] = {}
        self.moved: set[str] = set()
        # models: per model, the nodes whose entries read its replicas; seen: the counts
        # of the view's journals (`View.journal`, `View.uses`) when they were last
        # brought up to date.
        self.models: dict[str, set[str]] = {}
        self.seen: tuple[int, int] | None = None

    def stream(self, index: Kept, view: View, least: int, k: int) -> Iterator[WalkEntry]:
        journal, uses = view.journal, view.uses
        now = (journal.count, uses.count)
        if now != self.seen:
            if self.seen is not None:
                changed = journal.since(self.seen[0])
                used = uses.since(self.seen[1])
                if changed is None or used is None:
                    self.moved |= set(index._nodes)
                else:
                    replicas = view.state.replicas
                    models = self.models
                    # A change may be a loading time, which every node of its model
                    # reads; a use alone moves only the node whose entry reads it.
                    for m in {replicas[rid].model for rid in changed}:
                        self.moved |= models.get(m, set())
                    for rid in used:
                        r = replicas.get(rid)
                        if r is not None and r.nodes:
                            self.moved.add(r.nodes[0])
            self.seen = now
        if self.moved:
            self._refresh(index, view)
        if k not in self.by:
            self._build(index, view, k)
        return heapq.merge(*[got for g, got in self.by[k].items() if g >= least])

    def _build(self, index: Kept, view: View, k: int) -> None:
        by: dict[int, list[WalkEntry]] = {}
        at: dict[str, tuple[int, WalkEntry]] = {}
        loads: dict[str, float] = {}
        for name in index._nodes:
            got = _walk_entry(index, view, loads, name, k, self.models)
            if got is not None:
                at[name] = got
                by.setdefault(got[0], []).append(got[1])
        for entries in by.values():
            entries.sort()
        self.by[k], self.at[k] = by, at

    def _refresh(self, index: Kept, view: View) -> None:
        moved, self.moved = self.moved, set()
        loads: dict[str, float] = {}
        for k, at in self.at.items():
            if len(moved) * 4 > len(at):
                del self.by[k]  # built again when asked
                continue
            by = self.by[k]
            for name in moved:
                old = at.pop(name, None)
                if old is not None:
                    drop(by[old[0]], old[1])
                got = _walk_entry(index, view, loads, name, k, self.models)
                if got is not None:
                    at[name] = got
                    insort(by.setdefault(got[0], []), got[1])
        for k in [k for k in self.at if k not in self.by]:
            del self.at[k]


def _walk_entry(
    index: Kept,
    view: View,
    loads: dict[str, float],
    name: str,
    k: int,
    models: dict[str, set[str]],
) -> tuple[int, WalkEntry] | None:
    """A node's place in the walk for k victims, by the GPUs its k largest hold; None
    with fewer than k replicas. Each replica's model notes the node in `models`."""
    on = index._nodes.get(name)
    if on is None or len(on) < k:
        return None
    took = view.load_times()
    works, used = [], []
    for rep in on.values():
        r = rep.r
        models.setdefault(r.model, set()).add(name)
        load = loads.get(r.model)
        if load is None:
            # As `node_aware.load_costs` has it, so as `node_aware.key` sums it.
            times = took.get(r.model)
            load = loads[r.model] = 0.0 if not times else max(statistics.median(times), 0.0)
        works.append(load * rep.size.gpus)
        if r.last_used_at is not None:
            used.append(r.last_used_at)
    works.sort()
    used.sort()
    least = sum(works[:k])
    if len(used) >= k:
        return index._tops[name][k], (least, False, used[k - 1], name)
    return index._tops[name][k], (least, True, EPOCH, name)


class GangNodes:
    """Per node, the index's live multi-node replicas with a shard on it, whatever the
    model asking: kept while what `Kept.follow` brings the groups up to date from
    stays (the view, its quota tree, the catalog's version, the count of the view's
    journal) and the groups are those it was read from (built again from the start,
    `_reset`, they are a new dict). A later use alone (`View.uses`) moves no replica
    between nodes or in or out of the groups."""

    __slots__ = ("by_node", "count", "groups", "tree", "version", "view")

    def __init__(self, index: Kept, view: View, by_node: dict[str, list[Rep]]) -> None:
        self.view, self.tree, self.groups = view, view.quota, index._groups
        self.version, self.count = view.catalog.version, view.journal.count
        self.by_node = by_node

    @staticmethod
    def of(index: Kept, view: View) -> dict[str, list[Rep]]:
        got = index._gang_nodes
        if (
            got is not None
            and got.view is view
            and got.tree is view.quota
            and got.groups is index._groups
            and got.version == view.catalog.version
            and got.count == view.journal.count
        ):
            return got.by_node
        by_node: dict[str, list[Rep]] = {}
        for g in index._groups.values():
            for rep in g.multi.values():
                for n in rep.r.nodes:
                    by_node.setdefault(n, []).append(rep)
        index._gang_nodes = GangNodes(index, view, by_node)
        return by_node
