"""A realistic, seeded stream of events for projector tests and the projector benchmark.

`Mix(seed, nodes=...)` plays a cluster: the catalog and quota first, every node's
inventory, then placements walking through their states, lots of `replica.used`, drains,
failed placements, preemption decisions, holds, cordons, lost nodes and re-inventories.
With `bad=True` it mixes in invariant breakers (states going backwards, a report from the
wrong node, drains of unknown replicas) and messages that do not decode at all.

Items are `(subject, body, msg_id)`, the shape `Publisher.publish_many` and the bundle
writer take. Deterministic for a seed; no clock, no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from schemas import codec, subjects
from schemas import events as ev

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
GPU = "NVIDIA H100 80GB HBM3"

Item = tuple[str, bytes, str | None]

# Profiles of the mix: name -> (GPUs per shard, shards).
_PROFILES = {"tp1": (1, 1), "tp2": (2, 1), "tp4": (4, 1), "tp8x2": (8, 2)}
_MODELS = [
    ("llama-70b", "critical", "team-a", ("tp4", "tp8x2")),
    ("meta/llama-3.1-8b", "standard", "team-b", ("tp1", "tp2")),
    ("mixtral", "standard", "team-a", ("tp2", "tp4")),
    ("embed", "opportunistic", "team-c", ("tp1",)),
]


class Mix:
    """A cluster of `nodes` nodes x 8 GPUs, played forward one event at a time."""

    def __init__(
        self, seed: int, nodes: int = 50, root: str = subjects.DEFAULT_ROOT, used: float = 0.70
    ) -> None:
        self.rng = random.Random(seed)
        # used is the chance a step is one replica.used report; the other steps emit
        # several events each (a placement five), so 0.70 gives ~45% replica.used.
        self.used = used
        self.root = root
        self.nodes = [f"gpu-{i:04d}" for i in range(nodes)]
        self.free: dict[str, set[int]] = {n: set(range(8)) for n in self.nodes}
        self.live: dict[str, tuple[str, str, list[tuple[str, list[int]]], str]] = {}
        self.n = 0
        self.t = T0
        self.seed = seed
        self.next_replica = 0
        self.cordoned: set[str] = set()
        self.lost: set[str] = set()
        self.live_ids: list[str] = []
        self.pos: dict[str, int] = {}

    # ------------------------------------------------------------------ helpers

    def _id(self) -> str:
        self.n += 1
        return f"{self.seed:x}-{self.n:08d}"

    def _event(self, data: ev.Data, source: str = "test") -> ev.Event:
        self.t += timedelta(milliseconds=10)
        return ev.make(data, id=self._id(), time=self.t, source=source)

    def _item(self, e: ev.Envelope, node: str | None = None, subject: str | None = None) -> Item:
        subj = subject or subjects.subject_for(e, self.root, node)
        return subj, codec.encode(e), e.id

    def _inventory(self, node: str, gpus: int = 8) -> Item:
        return self._item(
            self._event(
                ev.NodeInventory(
                    node=node,
                    gpus=tuple(
                        ev.GpuInfo(index=i, uuid=f"GPU-{node}-{i}", model=GPU, memory_gb=80.0)
                        for i in range(gpus)
                    ),
                    cpu_cores=128.0,
                    memory_gb=1024.0,
                ),
                source=f"agent/{node}",
            )
        )

    # ------------------------------------------------------------------ the play

    def prologue(self) -> Iterator[Item]:
        yield self._item(
            self._event(
                ev.QuotaSet(
                    owners=(
                        ev.OwnerQuota(name="org"),
                        ev.OwnerQuota(
                            name="team-a", parent="org", guarantee=ev.Resources(gpus=200)
                        ),
                        ev.OwnerQuota(name="team-b", parent="org"),
                        ev.OwnerQuota(name="team-c", parent="org"),
                    )
                )
            )
        )
        for name, cls, owner, profs in _MODELS:
            yield self._item(
                self._event(
                    ev.ModelDeclared(
                        name=name,
                        owner=owner,
                        cls=cls,  # type: ignore[arg-type]
                        min=1,
                        max=10_000,
                        profiles=tuple(
                            ev.ProfileSpec(
                                name=p,
                                gpus=_PROFILES[p][0],
                                shards=_PROFILES[p][1],
                                cpu_cores=4.0,
                                memory_gb=32.0,
                            )
                            for p in profs
                        ),
                    )
                )
            )
            yield self._item(self._event(ev.ScaleDesired(model=name, replicas=100)))
        for node in self.nodes:
            yield self._inventory(node)

    def items(self, count: int, *, bad: bool = False) -> Iterator[Item]:
        """`count` items: the prologue, then the cluster's life."""
        made = 0
        for it in self.prologue():
            if made >= count:
                return
            yield it
            made += 1
        while made < count:
            for it in self.step(bad):
                if made >= count:
                    return
                yield it
                made += 1

    def step(self, bad: bool) -> list[Item]:
        """One thing happening in the cluster (one or a few events)."""
        if self.live and self.rng.random() < self.used:
            return [self._used()]
        r = 0.70 + 0.30 * self.rng.random()
        if r < 0.80:
            return self._place()
        if r < 0.86 and self.live:
            return self._drain()
        if r < 0.89:
            return self._failed_and_preempt()
        if r < 0.92:
            return [self._inventory(self.rng.choice(self.nodes))]
        if r < 0.94:
            return self._cordon()
        if r < 0.945:
            return self._lose()
        if r < 0.95:
            return [
                self._item(
                    self._event(ev.ViewDigest(seq=self.n, digest="00")),
                )
            ]
        if bad:
            return self._bad()
        return [self._used()] if self.live else self._place()

    def _used(self) -> Item:
        rid = self._pick()
        _, _, shards, _ = self.live[rid]
        e = self._event(ev.ReplicaUsed(replica=rid, at=self.t), source=f"agent/{shards[0][0]}")
        return self._item(e, node=shards[0][0])

    # live_ids lists the live replicas for O(1) random picks; pos maps id -> index.
    def _pick(self) -> str:
        return self.live_ids[self.rng.randrange(len(self.live_ids))]

    def _add(self, rid: str, rec: tuple[str, str, list[tuple[str, list[int]]], str]) -> None:
        self.live[rid] = rec
        self.pos[rid] = len(self.live_ids)
        self.live_ids.append(rid)

    def _remove(self, rid: str) -> tuple[str, str, list[tuple[str, list[int]]], str]:
        rec = self.live.pop(rid)
        i = self.pos.pop(rid)
        last = self.live_ids.pop()
        if last != rid:
            self.live_ids[i] = last
            self.pos[last] = i
        return rec

    def _place(self) -> list[Item]:
        name, _, _, profs = self.rng.choice(_MODELS)
        prof = self.rng.choice(profs)
        per, nshards = _PROFILES[prof]
        ok = [
            n
            for n in self.rng.sample(self.nodes, min(len(self.nodes), 16))
            if n not in self.lost and n not in self.cordoned and len(self.free[n]) >= per
        ]
        if len(ok) < nshards:
            return self._failed_and_preempt(name)
        shards = []
        for node in ok[:nshards]:
            gpus = sorted(self.free[node])[:per]
            self.free[node] -= set(gpus)
            shards.append((node, gpus))
        self.next_replica += 1
        rid = f"r-{self.seed:x}-{self.next_replica}"
        specs = tuple(ev.ShardSpec(node=n, gpus=tuple(g)) for n, g in shards)
        out = [
            self._item(
                self._event(
                    ev.PlacementDecided(
                        replica=rid, model=name, profile=prof, shards=specs, reason="best fit"
                    ),
                    source="scheduler",
                )
            ),
            self._item(
                self._event(
                    ev.ReplicaStart(replica=rid, model=name, profile=prof, shards=specs),
                    source="scheduler",
                )
            ),
        ]
        for state in ("starting", "loading", "ready"):
            e = self._event(
                ev.ReplicaState(replica=rid, model=name, profile=prof, state=state, shards=specs),  # type: ignore[arg-type]
                source=f"agent/{shards[0][0]}",
            )
            out.append(self._item(e, node=shards[0][0]))
        self._add(rid, (name, prof, shards, "ready"))
        return out

    def _drain(self) -> list[Item]:
        rid = self._pick()
        name, prof, shards, _ = self._remove(rid)
        reason = self.rng.choice(["scale_down", "preempted", "node_drain"])
        node = shards[0][0]
        specs = tuple(ev.ShardSpec(node=n, gpus=tuple(g)) for n, g in shards)
        out = [
            self._item(
                self._event(
                    ev.ReplicaDrain(
                        replica=rid,
                        model=name,
                        reason=reason,  # type: ignore[arg-type]
                        for_model="llama-70b" if reason == "preempted" else None,
                    ),
                    source="scheduler",
                ),
                node=node,
            )
        ]
        for state in ("draining", "stopped"):
            e = self._event(
                ev.ReplicaState(replica=rid, model=name, profile=prof, state=state, shards=specs),  # type: ignore[arg-type]
                source=f"agent/{node}",
            )
            out.append(self._item(e, node=node))
        for n, g in shards:
            self.free[n] |= set(g)
        return out

    def _failed_and_preempt(self, model: str | None = None) -> list[Item]:
        name = model or self.rng.choice(_MODELS)[0]
        failed = self._event(
            ev.PlacementFailed(
                model=name,
                profiles=("tp4",),
                live=3,
                desired=5,
                reason="no_fit",
                why={"tp4": "no node has 4 free GPUs"},
            ),
            source="scheduler",
        )
        out = [self._item(failed)]
        if self.live and self.rng.random() < 0.5:
            victim = self._pick()
            vm = self.live[victim][0]
            out.append(
                self._item(
                    self._event(
                        ev.PreemptionDecided(
                            for_model=name,
                            outcome="preempted",
                            victims=(
                                ev.Victim(
                                    replica=victim,
                                    model=vm,
                                    cls="standard",
                                    tier=2,
                                    above_min=True,
                                    idle_s=30.0,
                                    gpus=2,
                                ),
                            ),
                            considered=4,
                            trigger=failed.id,
                        ),
                        source="preemption",
                    )
                )
            )
            out.append(
                self._item(
                    self._event(
                        ev.HoldCreated(
                            model=vm, for_model=name, until=self.t + timedelta(minutes=5)
                        ),
                        source="preemption",
                    )
                )
            )
        elif self.rng.random() < 0.3:
            out.append(
                self._item(
                    self._event(ev.HoldReleased(model=name, reason="expired"), source="preemption")
                )
            )
        return out

    def _cordon(self) -> list[Item]:
        node = self.rng.choice(self.nodes)
        if node in self.cordoned:
            self.cordoned.discard(node)
            return [self._item(self._event(ev.NodeUncordoned(node=node), source="operator"))]
        self.cordoned.add(node)
        return [self._item(self._event(ev.NodeCordoned(node=node), source="operator"))]

    def _lose(self) -> list[Item]:
        node = self.rng.choice(self.nodes)
        out = [self._item(self._event(ev.NodeLost(node=node, reason="heartbeats missed")))]
        for rid, (name, prof, shards, _) in list(self.live.items()):
            if any(n == node for n, _ in shards):
                self._remove(rid)
                for n, g in shards:
                    self.free[n] |= set(g)
                other = next((n for n, _ in shards if n != node), None)
                if other is not None:
                    # A gang's other shards hold their GPUs until they stop: the agent of
                    # one, drained, says the replica stopped (about the whole replica, as
                    # an agent before `replica.state`'s `node` did).
                    specs = tuple(ev.ShardSpec(node=n, gpus=tuple(g)) for n, g in shards)
                    e = self._event(
                        ev.ReplicaState(
                            replica=rid, model=name, profile=prof, state="stopped", shards=specs
                        ),
                        source=f"agent/{other}",
                    )
                    out.append(self._item(e, node=other))
        # The agent comes back at once with a fresh inventory: the node is found again.
        out.append(self._inventory(node))
        return out

    def _bad(self) -> list[Item]:
        k = self.rng.randrange(5)
        if k == 0:
            return [(f"{self.root}.node.gpu-0000.replica.x", b"{not json", self._id())]
        if k == 1:
            return [(f"{self.root}.catalog.quota", b'{"type":"no.such","id":"x"}', self._id())]
        if k == 2:
            e = self._event(ev.ReplicaDrain(replica="r-nobody", model="embed", reason="scale_down"))
            return [self._item(e, node=self.nodes[0])]
        if k == 3 and self.live:
            rid = self._pick()
            name, prof, shards, _ = self.live[rid]
            e = self._event(
                ev.ReplicaState(replica=rid, model=name, profile=prof, state="pending"),
                source="agent",
            )
            return [self._item(e, node=shards[0][0])]
        rid = self._pick() if self.live else "r-none"
        wrong = self.rng.choice(self.nodes)
        e = self._event(ev.ReplicaUsed(replica=rid, at=self.t), source=f"agent/{wrong}")
        return [self._item(e, node=wrong)]


def items(
    seed: int, count: int, *, nodes: int = 50, bad: bool = False, used: float = 0.70
) -> list[Item]:
    """`count` items of a seeded mix."""
    return list(Mix(seed, nodes=nodes, used=used).items(count, bad=bad))
